"""The recorded build plan of the rollout's weight view (rollout/build_plan.py): a replayed build gives
exactly the weights of a fresh view after in-place parameter updates; a replaced parameter, moved storage or changed
LoRA state makes the plan stale (rebuilt the slow way, still exact); only the first build (and the first after
`release`) walks the model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from benchmarks.lora_switch_work import build_model
from hybridflow.engine.lora import adapters_disabled
from hybridflow.rollout import weights as weights_mod

LAYERS = 3
CPU = torch.device("cpu")
# (LoRA targets or None = full fine-tuning, generation dtype): fused = all-linear (q/k/v, gate/up fused copies);
# unfused = o/down adapted only; full bf16 = fp32 master weights cast; full fp32 = zero copy
CASES = {"lora-fused": ("all-linear", torch.bfloat16), "lora-unfused": (["o_proj", "down_proj"], torch.bfloat16),
         "lora-fused-fp32": ("all-linear", torch.float32), "full-bf16": (None, torch.bfloat16),
         "full-fp32": (None, torch.float32)}


def _model(case: str) -> tuple[nn.Module, torch.dtype]:
    targets, dtype = CASES[case]
    if targets is None:
        return build_model("tiny", LAYERS, lora_rank=0, lora_alpha=0.0), dtype
    return build_model("tiny", LAYERS, lora_rank=4, lora_alpha=8.0, targets=targets, base_dtype=dtype,
                       b_std=0.3), dtype


def _fresh(model: nn.Module, dtype: torch.dtype) -> weights_mod.ModelWeights:
    with torch.no_grad():
        return weights_mod.WeightView(model, dtype, CPU).build()


def _assert_same(got: weights_mod.ModelWeights, want: weights_mod.ModelWeights) -> None:
    a, b = got.tensors(), want.tensors()
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and torch.equal(x, y), i


def _step(model: nn.Module, seed: int) -> None:
    """An optimizer step on the trainable parameters (in place, storage unchanged)."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.05)
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
    opt.step()


@pytest.fixture
def slow_builds(monkeypatch) -> list[int]:
    """Counts `WeightView._build_slow` calls (the model walk that records a plan)."""
    calls = [0]
    slow = weights_mod.WeightView._build_slow

    def counted(self):
        calls[0] += 1
        return slow(self)

    monkeypatch.setattr(weights_mod.WeightView, "_build_slow", counted)
    return calls


@pytest.mark.parametrize("case", list(CASES))
def test_replay_after_optimizer_steps_equals_fresh_build(case, slow_builds):
    model, dtype = _model(case)
    view = weights_mod.WeightView(model, dtype, CPU)
    with torch.no_grad():
        first = view.build()
    for step in range(3):
        _step(model, step)
        before = slow_builds[0]
        with torch.no_grad():
            got = view.build()
        assert slow_builds[0] == before  # replayed, not walked again
        assert got is first and got.ptrs == tuple(t.data_ptr() for t in got.tensors())
        _assert_same(got, _fresh(model, dtype))
    assert slow_builds[0] == 1 + 3  # the view's first build + one per fresh view


def test_only_first_build_and_first_after_release_walk_the_model(slow_builds):
    model, dtype = _model("lora-fused")
    view = weights_mod.WeightView(model, dtype, CPU)
    ptrs = view.build().ptrs
    view.build()
    view.build()
    assert slow_builds[0] == 1
    view.release()
    assert view.build().ptrs == ptrs  # replanned over the same (kept) one-rank buffers: CUDA graphs stay valid
    view.build()
    assert slow_builds[0] == 2


def _replace_factor(model: nn.Module) -> None:
    p = model.model.layers[1].self_attn.q_proj.lora_B["default"].weight
    p.data = p.data.clone() * 1.5  # same parameter object, new storage


def _replace_base(model: nn.Module) -> None:
    lin = model.model.layers[0].mlp.down_proj
    lin = getattr(lin, "base_layer", lin)
    lin.weight = nn.Parameter(lin.weight.detach() * 0.5, requires_grad=lin.weight.requires_grad)  # a new object


def _scale_norm_storage(model: nn.Module) -> None:
    p = model.model.layers[2].input_layernorm.weight
    p.data = p.data.clone() + 0.25


def _round_trip_dtype(model: nn.Module) -> None:
    dtype = next(model.parameters()).dtype
    model.to(torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    model.to(dtype)  # every storage replaced (an offload and back does the same on a GPU)


def _untie(model: nn.Module) -> None:
    model.lm_head.weight = nn.Parameter(model.model.embed_tokens.weight.detach() * 2.0)


def _untie_embed(model: nn.Module) -> None:
    model.model.embed_tokens.weight = nn.Parameter(model.lm_head.weight.detach() * 2.0)


STALE = {"factor storage": _replace_factor, "base parameter object": _replace_base,
         "norm storage (zero copy in fp32)": _scale_norm_storage, "dtype round trip": _round_trip_dtype,
         "lm_head untied": _untie, "embeddings untied": _untie_embed}


@pytest.mark.parametrize("case", ["lora-fused", "lora-fused-fp32", "full-fp32"])
@pytest.mark.parametrize("change", list(STALE))
def test_stale_plan_is_rebuilt_exactly(case, change, slow_builds):
    model, dtype = _model(case)
    if change.endswith("untied"):
        model.lm_head.weight = model.model.embed_tokens.weight  # tied (the tiny preset is not)
    view = weights_mod.WeightView(model, dtype, CPU)
    with torch.no_grad():
        view.build()
        view.build()
    assert slow_builds[0] == 1
    if change == "factor storage" and case.startswith("full"):
        _replace_base(model)  # no adapters: replace a base parameter instead
    else:
        STALE[change](model)
    with torch.no_grad():
        got = view.build()
    assert slow_builds[0] == 2  # the plan was found stale and rebuilt
    _assert_same(got, _fresh(model, dtype))
    with torch.no_grad():
        assert view.build() is got  # and the new plan replays
    assert slow_builds[0] == 3  # (the fresh view's build)


def test_lora_state_change_makes_plan_stale(slow_builds):
    model, dtype = _model("lora-fused")
    view = weights_mod.WeightView(model, dtype, CPU)
    with torch.no_grad():
        merged = view.build()
        merged_q = merged.layers[0].q.clone()
        with adapters_disabled(model):
            base = view.build()
            _assert_same(base, _fresh(model, dtype))
        assert slow_builds[0] == 3  # plan, replan (adapters off), the fresh view
        assert not torch.equal(base.layers[0].q, merged_q)
        again = view.build()  # adapters back on: replanned, merged again
    assert slow_builds[0] == 4
    assert torch.equal(again.layers[0].q, merged_q)


@pytest.fixture(scope="module")
def fsdp_lora_engine():
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from hybridflow.config import load_config
    from hybridflow.engine import TrainEngine
    from hybridflow.workers.engine_specs import actor_spec

    cfg = load_config([], ["actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8",
                           "model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=all-linear"])
    yield TrainEngine(actor_spec(cfg), device="cpu")
    if own:
        dist.destroy_process_group()


def test_replay_on_one_rank_fsdp2_reads_dtensor_shards(fsdp_lora_engine, slow_builds):
    module = fsdp_lora_engine.module
    q = module.model.layers[0].self_attn.q_proj.base_layer.weight
    assert hasattr(q, "to_local")  # an FSDP2 DTensor parameter
    view = weights_mod.WeightView(module, torch.bfloat16, CPU)
    with torch.no_grad():
        view.build()
    lora = [p for p in module.parameters() if p.requires_grad]
    assert lora
    with torch.no_grad():
        for i, p in enumerate(lora):  # an optimizer-like in-place update of every adapter shard
            p.add_(0.01 * (i % 7 + 1))
        got = view.build()
    assert slow_builds[0] == 1
    _assert_same(got, _fresh(module, torch.bfloat16))
