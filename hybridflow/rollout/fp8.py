"""FP8 rollout (`rollout.quantization=fp8`): e4m3 decoder linears with per-output-channel scales, one GEMM function.

Decision: weights are quantized at each switch, after the LoRA merge, from the generation view (`weights.py`) into
persistent [layers, ...] buffers refilled in place, so captured CUDA graphs stay valid; scales are fp32 amax/448 per
output row (weights) and per token (activations, dynamic). Only q/k/v, o, gate/up and down: embeddings, norms and the
LM head stay in the generation dtype (the sampled distribution is read off the head). The GEMM is `torch._scaled_mm`
on CUDA, one of `GEMMS` (`HYBRIDFLOW_FP8_GEMM`, `tensorwise_fast` by default: torch's row-wise-scaled kernel was
slower than bf16 at decode's row counts); elsewhere an emulation with the same quantization and roundings (the fp8
values multiplied in fp32, then scaled) so that CPU tests check the numerics. No FP8 KV cache.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.rollout import moe as moe_ops
from hybridflow.rollout.weights import LayerWeights, ModelWeights

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_CAPABILITY = (8, 9)  # Ada / Hopper: the first chips with fp8 tensor cores
QUANTIZATIONS = ("none", "fp8")
_TINY = 1e-12  # amax floor: an all-zero row gets a tiny scale and zero codes, not 0/0
# How the GEMM applies the two scales. rowwise: `_scaled_mm` with row-wise scales (torch's CUTLASS kernel; one
# rounding of the scaled sum). tensorwise: `_scaled_mm` with unit tensor-wise scales (cuBLASLt) writes the unscaled
# sum in the output dtype, then one fp32 multiply by both scales (fused with the next op in the compiled decode
# pieces) rounds it again. _fast: `use_fast_accum` (Hopper keeps the fp8 MMA's ~fp22 accumulator instead of adding
# it into fp32 every 128 products; an error the emulation does not reproduce, below the e4m3 rounding's:
# tests/rollout/test_fp8.py bounds it).
GEMMS = ("tensorwise_fast", "tensorwise", "rowwise_fast", "rowwise")
GEMM_ENV = "HYBRIDFLOW_FP8_GEMM"
# The recipe `fp8_linear` uses when given none. `select_gemm` sets it from the environment when an fp8 engine is set
# up, not at import: a bad value must not break runs that never quantize.
GEMM = GEMMS[0]


def gemm_from_env() -> str:
    """`HYBRIDFLOW_FP8_GEMM` when set and not empty (one of `GEMMS`), else `tensorwise_fast`; ValueError otherwise."""
    gemm = os.environ.get(GEMM_ENV) or GEMMS[0]
    if gemm not in GEMMS:
        raise ValueError(f"{GEMM_ENV}={gemm!r} (read because rollout.quantization=fp8): use one of "
                         f"{', '.join(GEMMS)}, or unset it for {GEMMS[0]}")
    return gemm


def select_gemm() -> str:
    """Make `gemm_from_env()` the process's recipe (`GEMM`) and return it; called when an fp8 engine is set up,
    before anything is compiled or captured (compiled code reads `GEMM` as a constant)."""
    global GEMM
    GEMM = gemm_from_env()
    return GEMM


_ONES: dict[torch.device, torch.Tensor] = {}  # the unit fp32 scale of the tensorwise GEMMs, one per device


def unit_scale(device: torch.device) -> torch.Tensor:
    """The fp32 scalar 1 on `device` (the tensorwise GEMMs' scales), made once: `Fp8Weights.quantize` makes it before
    any forward, so compiled code and captured graphs only read it."""
    one = _ONES.get(device)
    if one is None:
        one = _ONES[device] = torch.ones((), dtype=torch.float32, device=device)
    return one


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes in float8_e4m3fn, fp32 scales [..., 1]) with x ≈ codes * scale, one scale per row (last dim)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """codes [..., N, K] * scale [..., N] (one scale per row) in fp32."""
    return codes.float() * scale.unsqueeze(-1)


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
               emulate: bool | None = None, gemm: str | None = None) -> torch.Tensor:
    """≈ F.linear(x, dequantize(w8, w_scale), bias) in x's dtype, with x quantized per token. x [..., K], w8 [N, K]
    (row-major, so `w8.t()` is the column-major second operand `_scaled_mm` needs), w_scale [N] fp32. `gemm`: one of
    `GEMMS` (default `GEMM`). `emulate` None: `_scaled_mm` on CUDA, the emulation elsewhere; True/False force one."""
    gemm = GEMM if gemm is None else gemm
    lead, k = x.shape[:-1], x.shape[-1]
    xq, x_scale = quantize_rows(x.reshape(-1, k))  # [M, K], [M, 1]
    if emulate is None:
        emulate = not x.is_cuda
    rowwise, fast = gemm.startswith("rowwise"), gemm.endswith("_fast")
    if emulate:
        acc = xq.float() @ w8.float().t()
        out = acc if rowwise else acc.to(x.dtype)  # tensorwise: the GEMM writes the unscaled sum in x's dtype
    elif rowwise:  # scale_a [M, 1], scale_b [1, N], both fp32; bf16 output; K and N multiples of 16
        out = torch._scaled_mm(xq, w8.t(), scale_a=x_scale, scale_b=w_scale[None], out_dtype=x.dtype,
                               use_fast_accum=fast)
    else:
        one = unit_scale(x.device)
        out = torch._scaled_mm(xq, w8.t(), scale_a=one, scale_b=one, out_dtype=x.dtype, use_fast_accum=fast)
    if emulate or not rowwise:  # |sum| <= 448² K: no overflow in bf16 before the scales
        out = (out.float() * x_scale * w_scale[None]).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, w8.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None) -> torch.Tensor:
    """The forward's decoder projection: `F.linear` for a plain weight, `fp8_linear` when it has a scale."""
    if scale is None:
        return F.linear(x, w, bias)
    return fp8_linear(x, w, scale, bias)


def check_supported(module: nn.Module, *, fallback_reason: str | None, tp_size: int, device: torch.device,
                    dtype: torch.dtype | None, gemm: str | None = None) -> None:
    """ValueError naming `rollout.quantization` when fp8 generation with recipe `gemm` (default `GEMM`) cannot run
    here (checked when the engine binds)."""
    gemm = GEMM if gemm is None else gemm
    why = None
    if fallback_reason:
        why = f"it needs our engine, but this model generates through HF generate ({fallback_reason})"
    elif tp_size > 1:
        why = f"rollout.tensor_model_parallel_size={tp_size}: fp8 is built for one rank per model; set it to 1"
    elif dtype == torch.float16:  # the tensorwise GEMMs write the unscaled sum (up to 448² K) in x's dtype
        why = ("the generation dtype is float16, whose range (65504) the unscaled fp8 sums overflow; generate in "
               "bfloat16 (model.dtype=bfloat16)")
    elif any(moe_ops.is_moe_layer(layer.mlp) for layer in module.model.layers):
        why = "MoE models are not supported (the experts stay unquantized); use rollout.quantization=none"
    elif device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        if cc < MIN_CAPABILITY:
            why = (f"{torch.cuda.get_device_name(device)} has compute capability {cc[0]}.{cc[1]}; FP8 GEMMs need "
                   f">= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Ada, Hopper or newer)")
        elif dtype != torch.bfloat16 and gemm.startswith("rowwise"):
            why = (f"the generation dtype is {dtype}; torch._scaled_mm with row-wise scales ({GEMM_ENV}={gemm}) "
                   "writes bfloat16 only")
        else:
            cfg = module.config
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            dims = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                    "num_key_value_heads*head_dim": cfg.num_key_value_heads * head_dim}
            odd = {k: v for k, v in dims.items() if v % 16}
            if odd:
                why = f"{odd} not multiples of 16, which torch._scaled_mm needs"
    if why is not None:
        raise ValueError(f"rollout.quantization='fp8': {why}")


class Fp8Weights:
    """Persistent fp8 copies of a `ModelWeights`' decoder projections (fused q/k/v and gate/up, o, down) with their
    scales, one [layers, ...] buffer per projection, refilled in place by `quantize` at each switch."""

    def __init__(self) -> None:
        self._stacks: dict[str, torch.Tensor] = {}

    def release(self) -> None:
        """Drop the stacks (`RolloutEngine.release_cache`: no captured graph refers to them any more)."""
        self._stacks.clear()

    def _stack(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = self._stacks.get(name)
        if buf is None or tuple(buf.shape) != shape or buf.device != device:
            buf = self._stacks[name] = torch.empty(shape, dtype=dtype, device=device)
        return buf

    def _fill(self, name: str, i: int, layers: int, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize the row blocks `parts` (each [rows, K]) into layer i's slice of the `name` stacks."""
        rows, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
        codes = self._stack(name, (layers, rows, k), FP8, parts[0].device)[i]
        scales = self._stack(name + "_scale", (layers, rows), torch.float32, parts[0].device)[i]
        r = 0
        for p in parts:
            q, s = quantize_rows(p)
            codes[r: r + p.shape[0]].copy_(q)
            scales[r: r + p.shape[0]].copy_(s.squeeze(-1))
            r += p.shape[0]
        return codes, scales

    def _bias(self, i: int, layers: int, lw: LayerWeights) -> torch.Tensor | None:
        """The fused q/k/v bias (the fp8 forward always takes the fused projection)."""
        if lw.q_bias is None or lw.qkv_bias is not None:
            return lw.qkv_bias
        parts = [lw.q_bias, lw.k_bias, lw.v_bias]
        out = self._stack("qkv_bias", (layers, sum(p.shape[0] for p in parts)), parts[0].dtype, parts[0].device)[i]
        torch.cat(parts, out=out)
        return out

    def quantize(self, weights: ModelWeights) -> ModelWeights:
        """The fp8 `ModelWeights`: the same embeddings, norms and LM head; each layer's projections quantized."""
        n = len(weights.layers)
        unit_scale(weights.embed.device)
        layers = []
        for i, lw in enumerate(weights.layers):
            assert lw.moe is None, "fp8: MoE layers are refused by check_supported"
            qkv, qkv_s = self._fill("qkv", i, n, [lw.qkv] if lw.qkv is not None else [lw.q, lw.k, lw.v])
            gate_up, gate_up_s = self._fill("gate_up", i, n, [lw.gate_up] if lw.gate_up is not None else
                                            [lw.gate, lw.up])
            o, o_s = self._fill("o", i, n, [lw.o])
            down, down_s = self._fill("down", i, n, [lw.down])
            q, k, v = qkv.split([lw.q.shape[0], lw.k.shape[0], lw.v.shape[0]])
            gate, up = gate_up.chunk(2)
            layers.append(dataclasses.replace(
                lw, q=q, k=k, v=v, qkv=qkv, qkv_scale=qkv_s, qkv_bias=self._bias(i, n, lw), o=o, o_scale=o_s,
                gate=gate, up=up, gate_up=gate_up, gate_up_scale=gate_up_s, down=down, down_scale=down_s))
        out = ModelWeights(embed=weights.embed, layers=layers, norm=weights.norm, lm_head=weights.lm_head,
                           owned_buffers=True)
        out.ptrs = tuple(t.data_ptr() for t in out.tensors())
        return out
