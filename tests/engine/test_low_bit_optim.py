"""`optim.optimizer` (engine/optim.py): torchao's 8-bit AdamW on the engine's FSDP2 (DTensor) parameters on one gloo
rank — its moments are quantized, it tracks torch's AdamW, skips a non-finite step, and resumes bit for bit through
the trainer's checkpoints (on the CPU torchao's update runs eagerly: engine/optim.py says why); the config refuses
combinations that cannot work, and a missing torchao names the fix."""

from __future__ import annotations

import sys

import pytest
import torch
from engine_testlib import make_batch, make_config, make_engine, nan_loss, nll_loss, train_step
from torch.distributed.tensor import DTensor

from hybridflow.checkpoint import CheckpointManager
from hybridflow.config import load_config
from hybridflow.engine import TrainEngine
from hybridflow.engine.optim import TORCHAO_PIN, build_optimizer, optimizer_state_bytes_per_param
from hybridflow.workers.engine_specs import sft_spec

pytest.importorskip("torchao")

EIGHT_BIT = "actor.optim.optimizer=adamw_8bit"
CLIPPED = ("actor.grad_clip=0.5", "actor.optim.weight_decay=0.1", "actor.optim.lr_warmup_steps=2")


def _flat(engine) -> dict[str, torch.Tensor]:
    """Weights, moments (a quantized moment as its codes and block scales), step counts, LR: local shards."""
    out = {f"module/{n}": p.detach().to_local().clone() for n, p in engine.module.named_parameters()}
    for p, state in engine.optimizer.state.items():
        name = next(n for n, q in engine.module.named_parameters() if q is p)
        for key, v in state.items():
            v = v.to_local() if isinstance(v, DTensor) else v
            parts = {"codes": v.codes, "scale": v.scale} if hasattr(v, "codes") else {"": v}
            out |= {f"optim/{name}/{key}/{k}": t.clone() for k, t in parts.items()}
    out["lr"] = torch.tensor([g["lr"] for g in engine.optimizer.param_groups], dtype=torch.float64)
    return out


def _train(engine, steps: int, loss=nll_loss) -> None:
    for _ in range(steps):
        train_step(engine, make_batch(8, seed=3), loss, mini_batch_size=4)  # 2 optimizer steps each


@pytest.mark.parametrize(("name", "state_kind", "tol"), [("adamw_8bit", "OptimState8bit", 0.05),
                                                         ("adamw_4bit", "OptimState4bit", 0.4)])
def test_moments_are_quantized_and_the_step_tracks_adamw(name, state_kind, tol, dist_group):
    low, full = make_engine(*CLIPPED, f"actor.optim.optimizer={name}"), make_engine(*CLIPPED)
    _train(low, 2)
    _train(full, 2)
    kinds = {type(s["exp_avg"].to_local()).__name__ for s in low.optimizer.state.values()}
    assert kinds == {state_kind, "Tensor"}, kinds  # large matrices quantized, norms kept in fp32
    moments = [s[k].to_local() for s in low.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    quantized = [m for m in moments if hasattr(m, "codes")]
    stored = sum(m.codes.nbytes + m.scale.nbytes for m in quantized) / (sum(m.numel() for m in quantized) / 2)
    assert stored == optimizer_state_bytes_per_param(name)  # the planner's number is what is allocated
    assert isinstance(low.optimizer.param_groups[0]["lr"], float)
    start = make_engine(*CLIPPED)
    for (param, p), q, p0 in zip(low.module.named_parameters(), full.module.parameters(), start.module.parameters(),
                                 strict=True):
        moved, off = float((q - p0).detach().norm()), float((p - q).detach().norm())
        assert off <= tol * moved, f"{name}, {param}: step {off:.2e} away from AdamW's, which moved {moved:.2e}"


def test_bf16_stochastic_rounding_keeps_bf16_masters_that_move(dist_group):
    engine = make_engine(*CLIPPED, "actor.optim.optimizer=adamw_bf16_sr", "actor.fsdp.param_dtype=bfloat16")
    start = [p.detach().to_local().clone() for p in engine.module.parameters()]
    _train(engine, 1)
    for p, p0 in zip(engine.module.parameters(), start, strict=True):
        assert p.dtype == torch.bfloat16 and not torch.equal(p.to_local(), p0)
    assert {s["exp_avg"].dtype for s in engine.optimizer.state.values()} == {torch.bfloat16}


def test_8bit_skips_a_non_finite_step(dist_group):
    engine = make_engine(EIGHT_BIT)
    _train(engine, 1)
    before = _flat(engine)
    train_step(engine, make_batch(8, seed=3), nan_loss)
    after = _flat(engine)
    assert all(torch.equal(before[k], after[k]) for k in before), "a non-finite step changed the state"


def test_8bit_resumes_bitwise_through_the_trainers_checkpoints(tmp_path, dist_group):
    straight = make_engine(*CLIPPED, EIGHT_BIT)
    _train(straight, 3)
    first = make_engine(*CLIPPED, EIGHT_BIT)
    _train(first, 2)
    with CheckpointManager(tmp_path, async_save=False, capture_rng=False) as mgr:
        mgr.save(2, {"actor": first.state_dict()})
    resumed = make_engine(*CLIPPED, EIGHT_BIT)
    loaded = CheckpointManager(tmp_path, capture_rng=False).load(tmp_path / "global_step_2",
                                                                 templates={"actor": resumed.state_dict()})
    resumed.load_state_dict(loaded.components["actor"])
    assert resumed.global_step == 2
    _train(resumed, 1)
    a, b = _flat(straight), _flat(resumed)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} entries differ after resume, e.g. {differ[:5]}"


@pytest.mark.parametrize(("overrides", "key"), [
    ((EIGHT_BIT, "actor.fsdp.optimizer_offload=cpu_step"), "actor.fsdp.optimizer_offload='cpu_step'"),
    (("actor.optim.optimizer=adamw_bf16_sr",), "actor.fsdp.param_dtype='float32'"),
    (("critic.optim.optimizer=adamw_4bit", "critic.fsdp.optimizer_offload=cpu_step"), "critic.fsdp.optimizer_offload"),
    (("actor.optim.optimizer=adam8bit",), "optim.optimizer='adam8bit'"),
])
def test_config_refuses_what_cannot_work(overrides, key):
    with pytest.raises(ValueError, match=key.replace("[", r"\[")):
        load_config(files=[], overrides=list(overrides))
    load_config(files=[], overrides=["actor.optim.optimizer=adamw_bf16_sr", "actor.fsdp.param_dtype=bfloat16"])


def test_host_step_refuses_a_low_bit_optimizer(dist_group):
    with pytest.raises(ValueError, match="optim.optimizer='adamw_8bit' with fsdp.optimizer_offload=cpu_step"):
        TrainEngine(sft_spec(make_config("actor.fsdp.optimizer_offload=cpu_step", "sft.optim.optimizer=adamw_8bit"),
                             total_steps=None, model_path=None), device="cpu")


def test_missing_torchao_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import fails as if not installed
    cfg = load_config(files=[], overrides=[EIGHT_BIT]).actor.optim
    with pytest.raises(ValueError, match=f"pip install {TORCHAO_PIN}"):
        build_optimizer([torch.nn.Parameter(torch.zeros(4))], cfg)


def test_state_bytes_per_param():
    got = {n: optimizer_state_bytes_per_param(n) for n in ("adamw", "adamw_8bit", "adamw_4bit", "adamw_bf16_sr")}
    assert got == {"adamw": 8.0, "adamw_8bit": 2.03125, "adamw_4bit": 1.0625, "adamw_bf16_sr": 4.0}
    with pytest.raises(ValueError, match="adamw_2bit"):
        optimizer_state_bytes_per_param("adamw_2bit")
