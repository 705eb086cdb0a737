"""The rollout's LoRA merge (rollout/weights.py) in place: every adapted matrix of the generation view is
W + (alpha/r)·B·A (fp32: to GEMM precision; bf16: within one rounding of the exact value), for fused (q/k/v,
gate/up) and unfused layouts; repeated switches with changed adapters merge into the same persistent stacks, with
no stacked copy of the weights (op tally of a switch)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.lora_switch_work import OpTally, build_model
from hybridflow.engine.lora import lora_factors
from hybridflow.rollout import weights as weights_mod

LAYERS = 4
PROJ = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
LAYOUTS = {"fused": "all-linear", "unfused": ["o_proj", "down_proj"]}  # unfused: q/k/v, gate/up unadapted


def _model(layout: str, dtype: torch.dtype) -> torch.nn.Module:
    return build_model("tiny", LAYERS, lora_rank=4, lora_alpha=8.0, targets=LAYOUTS[layout], base_dtype=dtype,
                       b_std=0.3)


def _check_merged(model: torch.nn.Module, weights: weights_mod.ModelWeights, dtype: torch.dtype) -> int:
    """Every view matrix vs its layer: adapted = W + s·B·A, the rest W exactly. Returns the adapted count."""
    adapted = 0
    for layer, lw in zip(model.model.layers, weights.layers):
        for name, path in PROJ.items():
            owner = layer.get_submodule(path)
            got = getattr(lw, name)
            factors = lora_factors(owner) if hasattr(owner, "lora_A") else None
            w = owner.weight
            if factors is None:
                assert torch.equal(got, w.to(dtype)), name
                continue
            adapted += 1
            b, a, scale = factors
            exact = w.double() + scale * (b.to(dtype).double() @ a.to(dtype).double())
            if dtype == torch.float32:
                torch.testing.assert_close(got.double(), exact, atol=1e-6, rtol=1e-6)
            else:  # one rounding of the exact sum: at most half a bf16 ulp (2^-8 relative), fp32 accumulation slack
                err = (got.double() - exact).abs()
                bound = exact.abs() * 2.0**-8 * (1 + 1e-3) + 1e-30
                assert bool((err <= bound).all()), (name, float((err / bound).max()))
    return adapted


@pytest.mark.parametrize("stack_bytes", [weights_mod.STACK_BYTES, 3000], ids=["one-batch", "small-batches"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_merged_weights_equal_base_plus_scaled_delta(layout, dtype, stack_bytes, monkeypatch):
    monkeypatch.setattr(weights_mod, "STACK_BYTES", stack_bytes)  # 3000 B: ~2 layers' factors per batch
    model = _model(layout, dtype)
    with torch.no_grad():
        weights = weights_mod.WeightView(model, dtype, torch.device("cpu")).build()
    n = _check_merged(model, weights, dtype)
    assert n == LAYERS * (7 if layout == "fused" else 2)
    lw, layer = weights.layers[0], model.model.layers[0]
    if layout == "unfused":  # unadapted, same dtype: the parameters themselves
        assert lw.qkv is None and lw.q.data_ptr() == layer.self_attn.q_proj.weight.data_ptr()
    else:
        assert lw.qkv is not None and lw.gate_up is not None


def _stack_ptrs(weights: weights_mod.ModelWeights, names: list[str]) -> dict[str, int]:
    """Storage of each projection's copies; all layers' copies of one projection share it (one stack)."""
    out = {}
    for name in names:
        ptrs = {getattr(lw, name).untyped_storage().data_ptr() for lw in weights.layers}
        assert len(ptrs) == 1, (name, ptrs)
        out[name] = ptrs.pop()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_repeated_switches_merge_changed_adapters_in_the_same_stacks(dtype):
    model = _model("fused", dtype)
    view = weights_mod.WeightView(model, dtype, torch.device("cpu"))
    with torch.no_grad():
        first = view.build()
    _check_merged(model, first, dtype)
    stacks = _stack_ptrs(first, list(PROJ))
    factor_stack = LAYERS * max(p.numel() for n, p in model.named_parameters() if ".lora_" in n) * dtype.itemsize
    g = torch.Generator().manual_seed(1)
    for switch in range(3):
        with torch.no_grad():  # as an optimizer step would: every adapter changes
            for name, p in model.named_parameters():
                if ".lora_" in name:
                    p.add_(torch.randn(p.shape, generator=g) * 0.1)
            tally = OpTally()
            with tally:
                weights = view.build()
        _check_merged(model, weights, dtype)
        assert weights.ptrs == first.ptrs, switch  # the runner's views did not move
        assert _stack_ptrs(weights, list(PROJ)) == stacks, switch  # the same persistent stacks, no new ones
        # merged in place: one baddbmm_ per projection on the stack, no stack/cat of weights; the only fresh
        # tensors are the stacked rank-4 factors (a stack of weights would be >= 4x larger)
        assert tally.ops["baddbmm_"] == len(PROJ), tally.ops
        assert not {"stack", "cat", "clone", "addmm_"} & set(tally.ops), tally.ops
        assert 0 < tally.largest <= factor_stack, (tally.largest, factor_stack)
