"""The fused Triton sampler vs the torch sampler (`sampling.sample`): same tokens (bit-identical counter noise),
same log-probs, first-index tie breaking, for any split of the vocab over programs, and the `filtered` mode handed
to torch.

Runs the kernel in-process on a GPU; without one, `test_kernel_under_interpreter` reruns this file in a subprocess
with TRITON_INTERPRET=1 (triton fixes its mode when first imported, which torch >= 2.13 does with torch itself).
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import CUDA, DEV, needs_kernel, rerun_under_triton_interpreter

pytest.importorskip("triton")
from hybridflow.rollout import sample_kernel as sk  # noqa: E402
from hybridflow.rollout.sampling import kernel_sample, row_seed, sample  # noqa: E402
from hybridflow.utils import triton_util  # noqa: E402


def _args(N, V, temp=0.7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=g) * 3).to(DEV)
    seeds = torch.tensor([row_seed(seed, i) for i in range(N)], device=DEV)
    steps = torch.arange(N, device=DEV) % 7
    t = torch.tensor(temp, device=DEV)
    return logits, t, torch.tensor(V, device=DEV), torch.tensor(1.0, device=DEV), seeds, steps


@needs_kernel
@pytest.mark.parametrize("mode", ["sample", "greedy"])
@pytest.mark.parametrize("V,splits", [
    (50, None), (3000, None), (5000, None),  # below, across and not a multiple of BLOCK_V; one split
    (5000, 2), (5000, 3),  # last split shorter than the others; one split per BLOCK_V chunk
    (5000, 5),  # more splits than chunks: two empty splits
    (20000, None), (20000, 1), (20000, 7),  # auto = 3 splits of 8192 (last 3616); one program per row; 7 ragged
])
def test_kernel_matches_torch_sampler(mode, V, splits):
    logits, *rest = _args(16, V)
    logits[3, 17] = float("-inf")  # a masked token is never drawn and does not break the logsumexp
    logits[5, : V // 2] = float("-inf")  # whole splits masked: their partials must not poison the merge
    tok, logp = sk.fused_sample(logits, mode, *rest, num_splits=splits)
    ref_tok, ref_logp = sample(logits, mode, *rest)
    assert torch.equal(tok, ref_tok)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("splits", [1, 2, 3, 4])
def test_greedy_ties_take_the_first_index_and_strided_rows_work(splits):
    logits = torch.zeros(3, 4200, device=DEV)
    logits[0, [5, 2100, 4100]] = 2.0  # tie across chunks, lanes and (splits >= 2) splits
    logits[1, [4099, 4098]] = 1.0
    wide = torch.zeros(3, 5000, device=DEV)
    wide[:, :4200] = logits
    _, t, k, p, seeds, steps = _args(3, 4200)
    tok, _ = sk.fused_sample(wide[:, :4200], "greedy", t, k, p, seeds, steps, num_splits=splits)  # strided rows
    assert tok.tolist() == [5, 4098, 0]


@needs_kernel
def test_split_count_changes_no_token():
    logits, *rest = _args(8, 9000, temp=2.0)
    toks, logps = zip(*(sk.fused_sample(logits, "sample", *rest, num_splits=n) for n in (1, 2, 3, 5, 8)))
    assert all(torch.equal(t, toks[0]) for t in toks)
    for lp in logps:
        torch.testing.assert_close(lp, logps[0], atol=1e-5, rtol=0)


def test_auto_splits_is_a_function_of_the_vocab():
    assert [sk.auto_splits(v) for v in (1, 50, 8192, 8193, 151936)] == [1, 1, 1, 2, 19]


def test_filtered_mode_uses_torch():
    logits, t, _, _, seeds, steps = _args(8, 40)
    k, p = torch.tensor(5, device=DEV), torch.tensor(0.9, device=DEV)
    tok, logp = kernel_sample(logits, "filtered", t, k, p, seeds, steps)
    ref_tok, ref_logp = sample(logits, "filtered", t, k, p, seeds, steps)
    assert torch.equal(tok, ref_tok) and torch.equal(logp, ref_logp)
    with pytest.raises(ValueError, match="filtered"):
        sk.fused_sample(logits, "filtered", t, k, p, seeds, steps)


@pytest.mark.skipif(not CUDA, reason="Qwen2 vocab at decode batch size and CUDA graphs need a GPU")
def test_qwen_vocab_on_cuda_and_graph_capture():
    logits, t, k, p, seeds, steps = _args(256, 151936)
    logits = logits.to(torch.bfloat16)
    tok, logp = sk.fused_sample(logits, "sample", t, k, p, seeds, steps)  # compile outside capture
    ref_tok, ref_logp = sample(logits, "sample", t, k, p, seeds, steps)
    assert torch.equal(tok, ref_tok)
    torch.testing.assert_close(logp, ref_logp, atol=1e-4, rtol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_tok, g_logp = sk.fused_sample(logits, "sample", t, k, p, seeds, steps)
    steps.add_(1)  # replay must see the new steps
    graph.replay()
    torch.cuda.synchronize()
    ref_tok, ref_logp = sample(logits, "sample", t, k, p, seeds, steps)
    assert torch.equal(g_tok, ref_tok)
    torch.testing.assert_close(g_logp, ref_logp, atol=1e-4, rtol=0)


@pytest.mark.skipif(CUDA or triton_util.INTERPRETED, reason="the kernel runs in this process")
def test_kernel_under_interpreter():
    rerun_under_triton_interpreter(__file__)
