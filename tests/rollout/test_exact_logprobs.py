"""`actor_rollout.exact_logprobs`: the rollout engine's sampled-token log-probs equal the trainer's packed forward
bit for bit (torch.equal, CPU fp32, tiny Qwen2 and Phi-3) — ragged prompts, rows stopping at different steps, any
micro-batching, multi-turn KV reuse, after an optimizer step — and a perturbed key-block order breaks it; on a
GPU the same in bf16 through the Triton forms (engine/invariant_kernels.py), the rollout's fused q/k/v and gate/up
copies included (test_exact_forward.py), with and without CUDA graphs (run by benchmarks/gpu_tests.sh).
Small tiles (ROW_TILE 16, KEY_BLOCK 8) so that these short sequences cross several tiles and key blocks."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rollout_helpers import CUDA, EOS, PAD, make_model, make_prompts, rollout_cfg
from test_multi_turn import AlwaysCall, Echo

from hybridflow.agentic.session import ToolSession
from hybridflow.config import load_config
from hybridflow.engine import HeadRequest, TrainEngine, UpdatePlan, invariant, train_update
from hybridflow.engine.spec import MicroBatching
from hybridflow.models.tokenizer import builtin_tokenizer, save_builtin_tokenizer
from hybridflow.rollout import RolloutEngine
from hybridflow.workers.engine_specs import actor_spec

P, R = 12, 14
HEAD = HeadRequest("lm", temperature=0.7)


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    monkeypatch.setattr(invariant, "ROW_TILE", 16)
    monkeypatch.setattr(invariant, "KEY_BLOCK", 8)


def _engines(tmp_path, exact: bool = True, device: str = "cpu", family: str = "qwen",
             **cfg_kw) -> tuple[TrainEngine, RolloutEngine]:
    model = make_model(family)
    model.save_pretrained(tmp_path)
    save_builtin_tokenizer(tmp_path)
    cfg = load_config([], [f"model.path={tmp_path}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                           "actor.ppo_micro_batch_size_per_gpu=8", "actor.log_prob_micro_batch_size_per_gpu=8",
                           "actor.grad_clip=1e6", "actor.optim.lr=1e-2", f"actor_rollout.exact_logprobs={exact}"])
    train = TrainEngine(actor_spec(cfg), device=device)
    # many stop ids: rows finish at different steps
    stops = list(range(3, 99, 7))
    rollout = RolloutEngine(train.module, rollout_cfg(free_cache_engine=False, temperature=0.7,
                                                      stop_token_ids=stops, **cfg_kw),
                            eos_token_id=EOS, pad_token_id=PAD, max_prompt_length=P, max_response_length=R,
                            exact_logprobs=exact)
    return train, rollout


def _trainer_logprobs(train: TrainEngine, out, micro: int) -> torch.Tensor:
    train.spec = dataclasses.replace(train.spec, infer_batching=MicroBatching(micro))
    return train.infer(out, HEAD)["log_probs"] * out.batch["response_mask"]


def _rollout_logprobs(out) -> torch.Tensor:
    return out.batch["rollout_log_probs"] * out.batch["response_mask"]


def _equal_after_a_step_and_a_switch(train, rollout, out, P: int) -> None:
    """One optimizer step on `out`, the weight switch, a new generation: still the trainer's bits."""
    train_update(train, out, lambda o, mb, n: (-(o["log_probs"] * mb.batch["response_mask"]).sum() / 50, {}),
                 HEAD, UpdatePlan(8))
    rollout.sync_weights()
    out2 = rollout.generate(make_prompts(4, P, 300, seed=5, meta={"n": 2}))
    assert torch.equal(_trainer_logprobs(train, out2, 5), _rollout_logprobs(out2))


@pytest.mark.parametrize("family", ["qwen", "phi3"])  # phi3: q/k/v and gate/up fused in the module
def test_rollout_logprobs_equal_trainer_bitwise(gloo, tmp_path, family):
    train, rollout = _engines(tmp_path, family=family)
    out = rollout.generate(make_prompts(4, P, 300, seed=3, meta={"n": 2}))
    lengths = out.batch["response_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 2 and int(lengths.max()) + P > 2 * invariant.KEY_BLOCK, lengths
    ours = _rollout_logprobs(out)
    assert int((ours != 0).sum()) == int(lengths.sum())
    for micro in (8, 3, 1):  # packed rows of 8, 3 and 1 sequences: other tiles, same bits
        assert torch.equal(_trainer_logprobs(train, out, micro), ours), micro
    _equal_after_a_step_and_a_switch(train, rollout, out, P)


def test_multi_turn_kv_reuse_is_bitwise(gloo, tmp_path):
    train, rollout = _engines(tmp_path)
    rollout.R = R
    rollout.session = ToolSession({"echo": Echo()}, AlwaysCall(), builtin_tokenizer(), max_assistant_turns=3,
                                  max_tool_response_length=16, tool_timeout_s=5.0, tool_workers=2)
    out = rollout.generate(make_prompts(3, P, 300, seed=1, meta={"n": 2}))
    assert out.meta_info["metrics"]["tool_calls/max"] >= 1
    assert torch.equal(_trainer_logprobs(train, out, 4), _rollout_logprobs(out))


def test_other_key_block_on_one_side_breaks_equality(gloo, tmp_path, monkeypatch):
    train, rollout = _engines(tmp_path)
    out = rollout.generate(make_prompts(4, P, 300, seed=3, meta={"n": 2}))
    monkeypatch.setattr(invariant, "KEY_BLOCK", 4)  # the trainer reduces over keys in other blocks
    ours, theirs = _trainer_logprobs(train, out, 8), _rollout_logprobs(out)
    assert not torch.equal(ours, theirs)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)  # still the same function


def test_default_mode_differs_in_the_last_bits(gloo, tmp_path):
    """Documents the gap the switch removes: without it the engines round differently (CPU fp32 here)."""
    train, rollout = _engines(tmp_path, exact=False)
    out = rollout.generate(make_prompts(4, P, 300, seed=3, meta={"n": 2}))
    ours, theirs = _trainer_logprobs(train, out, 8), _rollout_logprobs(out)
    assert not torch.equal(ours, theirs)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def check_cuda_bf16(tmp_path: Path, eager: bool) -> None:
    """The bitwise checks on CUDA in bf16 (run by the test below in a process with an NCCL group)."""
    train, rollout = _engines(tmp_path, device="cuda", enforce_eager=eager)
    assert rollout.dtype == torch.bfloat16 and rollout.use_graphs is not eager
    out = rollout.generate(make_prompts(4, P, 300, seed=3, meta={"n": 2}))
    ours = _rollout_logprobs(out)
    for micro in (8, 3):
        assert torch.equal(_trainer_logprobs(train, out, micro), ours), micro
    _equal_after_a_step_and_a_switch(train, rollout, out, P)


CUDA_SCRIPT = r"""
import sys, torch, torch.distributed as dist
from pathlib import Path
sys.path[:0] = ["tests/rollout"]
import test_exact_logprobs as t
from hybridflow.engine import invariant, invariant_kernels
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
eager = sys.argv[2] == "1"
if not eager:  # small tiles: several tiles and key blocks; eager runs the shipped sizes
    invariant.ROW_TILE, invariant.KEY_BLOCK = 16, 8
used = set()  # both engines' forwards go through the Triton forms on CUDA; the rollout's bf16 copies are fused
for name in ("linear", "rms_norm", "attention"):
    def counted(*a, _f=getattr(invariant_kernels, name), _n=name, **kw):
        used.add(_n + (" fused" if kw.get("block_n") else ""))
        return _f(*a, **kw)
    setattr(invariant_kernels, name, counted)
t.check_cuda_bf16(Path(sys.argv[1]), eager)
assert used == {"linear", "linear fused", "rms_norm", "attention"}, used
dist.destroy_process_group()
print("exact cuda ok")
"""


@pytest.mark.skipif(not CUDA, reason="CUDA bf16 (benchmarks/gpu_tests.sh)")
@pytest.mark.parametrize("eager", [False, True])
def test_cuda_bf16_bitwise_with_and_without_graphs(tmp_path, eager):
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", CUDA_SCRIPT, str(tmp_path), str(int(eager))], cwd=root,
                          capture_output=True, text=True, timeout=600, env=os.environ | {"PYTHONPATH": str(root)})
    assert proc.returncode == 0 and "exact cuda ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
