"""The on-device sampler against naive references: softmax frequencies and HF's top-k/top-p warpers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rollout_helpers import make_engine, make_model, rollout_cfg
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hybridflow.rollout.forward import DecodeOps
from hybridflow.rollout.sampling import (
    SamplingParams,
    build_sampler,
    kernel_sample,
    row_seed,
    sample,
    sampler_values,
)
from hybridflow.rollout.sampling import uniform_from_counter as uniform
from hybridflow.utils.triton_util import triton_available


def _draw(logits_V: torch.Tensor, params: SamplingParams, n: int = 40000) -> tuple[torch.Tensor, torch.Tensor]:
    temp, k, p = (torch.tensor(v) for v in sampler_values(params, logits_V.shape[0]))  # what the runner sets
    seeds = torch.tensor([row_seed(7, i) for i in range(n)])
    return sample(logits_V.expand(n, -1), params.mode, temp, k, p, seeds, torch.full((n,), 3))


def test_uniform_is_batch_invariant_and_uniform():
    seeds = torch.tensor([row_seed(1, i) for i in range(20000)])
    steps = torch.arange(20000) % 97
    u = uniform(seeds, steps)
    assert u.min() >= 0 and u.max() < 1
    torch.testing.assert_close(uniform(seeds[5:9], steps[5:9]), u[5:9], atol=0, rtol=0)
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max() < 0.01, hist
    # different steps of one seed are different draws
    assert uniform(seeds[:1].repeat(50), torch.arange(50)).unique().numel() == 50


def test_sample_frequencies_and_logprobs_match_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, -3.0])
    params = SamplingParams(temperature=0.7)
    tok, logp = _draw(logits, params)
    ref = torch.softmax(logits / 0.7, -1)
    freq = torch.bincount(tok, minlength=6).float() / tok.numel()
    assert (freq - ref).abs().max() < 0.01, (freq, ref)
    torch.testing.assert_close(logp, ref.log()[tok])


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (-1, 0.8), (4, 0.7)])
def test_filtered_matches_hf_warpers(top_k, top_p):
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, -3.0, 1.5, 0.2])
    params = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p)
    tok, logp = _draw(logits, params)
    ref_scores = TemperatureLogitsWarper(0.9)(None, logits[None].clone())
    if top_k > 0:
        ref_scores = TopKLogitsWarper(top_k)(None, ref_scores)
    if top_p < 1:
        ref_scores = TopPLogitsWarper(top_p)(None, ref_scores)
    ref = torch.softmax(ref_scores[0], -1)
    freq = torch.bincount(tok, minlength=8).float() / tok.numel()
    assert ((ref == 0) <= (freq == 0)).all(), (freq, ref)  # filtered tokens are never drawn
    assert (freq - ref).abs().max() < 0.01, (freq, ref)
    torch.testing.assert_close(logp, ref.log()[tok])


def test_greedy_is_argmax_with_tempered_logprob():
    logits = torch.randn(4, 10)
    temp, k, p = torch.tensor(2.0), torch.tensor(10), torch.tensor(1.0)  # `sample` honours any temperature
    tok, logp = sample(logits, "greedy", temp, k, p, torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    assert torch.equal(tok, logits.argmax(-1))
    torch.testing.assert_close(logp, torch.log_softmax(logits / 2.0, -1).gather(-1, tok[:, None]).squeeze(-1))


def test_params_validation_and_overrides():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=0)
    p = SamplingParams.from_config(rollout_cfg(n=4, top_k=5, stop_token_ids=[3]))
    assert (p.n, p.top_k, p.stop_token_ids, p.mode) == (4, 5, (3,), "filtered")
    q = p.with_overrides({"n": 1, "do_sample": False, "unrelated": 1})
    assert (q.n, q.mode) == (1, "greedy")
    assert SamplingParams.from_config(rollout_cfg(), validate=True).mode == "greedy"


def test_the_engine_picks_its_sampler_once_per_device():
    """One typed `Sampler` chosen at the engine's set-up (not a field of the decode ops swapped per device)."""
    cpu = torch.device("cpu")
    assert build_sampler(cpu, compiled=False) is sample
    compiled = build_sampler(cpu, compiled=True)
    assert compiled is build_sampler(cpu, compiled=True) and compiled.fn is sample  # one process-wide compile
    if torch.cuda.is_available() and triton_available("cuda"):
        assert build_sampler(torch.device("cuda"), compiled=False) is kernel_sample
    runner = make_engine(make_model("tiny"))._prepare()
    assert runner.sampler is sample and "sample" not in {f.name for f in dataclasses.fields(DecodeOps)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        runner.ops.attention = None
