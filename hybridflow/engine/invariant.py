"""Batch-invariant forward ops: each token's result has the same bits however many tokens share the call.

Decision: fixed shapes instead of trusting kernels. Every row-local op (linear, RMSNorm, log-softmax) runs on
tiles of exactly `ROW_TILE` rows, the last one zero-padded, so the kernel — and its reduction order — never
depends on how many rows the caller has (CPU sgemm takes a different path below ~4 rows; CUDA GEMMs and reductions
pick configurations, split-K included, by shape). Attention reduces over keys in blocks of `KEY_BLOCK` keys counted
from the sequence's first key (online softmax, fp32), for tiles of `ROW_TILE` queries, so a query meets the same
blocks in the trainer's packed forward as in the rollout's prefill, decode and multi-turn extension; blocks past a
query's last key are masked whole and change no bit. Both engines call these ops under `actor_rollout.
exact_logprobs`; `install` puts them into an HF model (Linear and RMSNorm forwards), `EXACT_KWARG` selects
`attention` in the packed attention function, and the rollout may run a fused [q; k; v] or [gate; up] matrix as
`split_linear` (one GEMM, the parts' bits). Here plain torch (CPU; a loop of tiles); on CUDA the Triton forms of
invariant_kernels.py. Only forward values must match: each op is an autograd Function with the plain op's backward.

Legend: M rows, N queries, H heads, Hkv kv heads, G = H / Hkv, D head dim, C cache columns, B key block.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from hybridflow.engine import invariant_kernels
from hybridflow.utils.triton_util import triton_available

logger = logging.getLogger(__name__)

ROW_TILE = 64  # rows per GEMM / reduction call: shared by both engines, so any value works; 64 >= CPU gemv cutoff
KEY_BLOCK = 64  # keys per online-softmax step, counted from each sequence's first key
EXACT_KWARG = "hf_exact_attention"  # forward kwarg: the packed attention function uses `attention`


def _on_kernels(x: torch.Tensor) -> bool:
    """The Triton forms (invariant_kernels.py) on CUDA with Triton, and under the Triton interpreter (tests); the
    torch loops elsewhere. Both engines decide the same way for the same device."""
    return triton_available(x.device)


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn over x [..., K] in tiles of exactly ROW_TILE rows (leading dims flattened, the last tile zero-padded);
    fn must be row-local. Row i's output is fn's output for row i in a [ROW_TILE, K] call, whatever M is."""
    lead = x.shape[:-1]
    x_MK = x.reshape(-1, x.shape[-1])
    M = x_MK.shape[0]
    out = []
    for s in range(0, M, ROW_TILE):
        t = x_MK[s:s + ROW_TILE]
        n = t.shape[0]
        if n < ROW_TILE:
            t = torch.cat([t, t.new_zeros(ROW_TILE - n, t.shape[1])])
        out.append(fn(t.contiguous())[:n])
    y = torch.cat(out) if out else fn(x_MK.new_zeros(ROW_TILE, x_MK.shape[1]))[:0]
    return y.reshape(*lead, y.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, batch-invariant (fixed row tiles; the weight must be the same contiguous [out, in] on both sides).
    Backward is F.linear's (two GEMMs over all rows)."""
    return _Linear.apply(x, weight, bias)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        if _on_kernels(x):
            return invariant_kernels.linear(x, weight, bias)
        return rowwise(lambda t: F.linear(t, weight, bias), x)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        dy_MN = dy.reshape(-1, dy.shape[-1])
        dx = (dy_MN @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = dy_MN.T @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        db = dy_MN.sum(0) if ctx.needs_input_grad[2] else None
        return dx, dw, db


def fusable(x: torch.Tensor, sizes: Sequence[int]) -> bool:
    """Whether `split_linear` gives parts of these output sizes their own `linear` bits here: on the Triton kernels
    with one tile width for all parts. Not the torch loop: CPU GEMMs may round a row's outputs differently for
    another N."""
    return _on_kernels(x) and invariant_kernels.shared_block_n(sizes) is not None


def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """`linear(x, part, part_bias)` for each row block of `weight` [sum(sizes), K] (`bias` likewise), in one GEMM
    run with the parts' tile width: the bits of the separate calls (`fusable` must hold). Forward only (the
    rollout's); the results are column views of one [..., sum(sizes)] output."""
    if weight.shape[0] != sum(sizes) or (bias is not None and bias.shape[0] != sum(sizes)):
        raise ValueError(f"split_linear: weight {tuple(weight.shape)} / bias "
                         f"{None if bias is None else tuple(bias.shape)} do not stack parts of sizes {list(sizes)}")
    if not fusable(x, sizes):
        raise ValueError(f"split_linear: parts of sizes {list(sizes)} on {x.device} have no fused GEMM with their own "
                         f"bits (the torch loop, or tile widths {[invariant_kernels._block_n(n) for n in sizes]}); "
                         "call `linear` per part")
    y = invariant_kernels.linear(x, weight, bias, block_n=invariant_kernels.shared_block_n(sizes))
    return tuple(y.split(list(sizes), dim=-1))


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama/Qwen RMSNorm (fp32 statistics, weight applied in the input dtype), batch-invariant. Backward
    recomputes the plain norm over all rows and differentiates it."""
    return _RMSNorm.apply(x, w, eps)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        if _on_kernels(x):
            return invariant_kernels.rms_norm(x, w, eps)
        return rowwise(lambda t: _rms_norm(t, w, eps), x)

    @staticmethod
    @once_differentiable
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (*_recompute_grads(lambda x, w: _rms_norm(x, w, ctx.eps), ctx, dy), None)


def token_logprobs(logits_NV: torch.Tensor, labels_N: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / temperature)[label] [N] fp32, batch-invariant. `temperature` is a 0-d fp32 tensor on
    the logits' device on both sides (a host scalar may become a reciprocal multiply: other bits; a device tensor
    also lets a captured CUDA graph serve any temperature)."""
    def logz(t: torch.Tensor) -> torch.Tensor:
        z = t.float() / temperature
        m = z.amax(-1, keepdim=True)
        return m + torch.log(torch.exp(z - m).sum(-1, keepdim=True))

    picked_N = logits_NV.gather(-1, labels_N[:, None].long())[:, 0].float() / temperature
    if _on_kernels(logits_NV):
        return picked_N - invariant_kernels.logsumexp(logits_NV, temperature)
    return picked_N - rowwise(logz, logits_NV)[:, 0]


def attention(q_NHD: torch.Tensor, k_SHCD: torch.Tensor, v_SHCD: torch.Tensor, rows_N: torch.Tensor,
              first_N: torch.Tensor, last_N: torch.Tensor, num_blocks: int | None, scale: float) -> torch.Tensor:
    """o [N, H, D] (q's dtype): query i attends to keys k[rows[i], :, first[i] .. last[i]] (inclusive, contiguous)
    in blocks of KEY_BLOCK columns from first[i]; `num_blocks` bounds every query's block count (extra blocks are
    masked whole and change no bit; static for a CUDA graph), None = each query tile's own need (one host read).
    Torch: queries in tiles of ROW_TILE (the last one repeats its last query), scores and softmax in fp32; the
    Triton form (CUDA) is one program per query and kv head, each stopping at its own last block."""
    if _on_kernels(q_NHD):
        return invariant_kernels.attention(q_NHD, k_SHCD, v_SHCD, rows_N, first_N, last_N, scale, KEY_BLOCK)
    N, H, D = q_NHD.shape
    hkv = k_SHCD.shape[1]
    if num_blocks is None:  # the causal triangle: a tile of early queries runs few blocks
        need = (last_N - first_N) // KEY_BLOCK + 1
        num_blocks = torch.cat([need, need.new_zeros(-N % ROW_TILE)]).view(-1, ROW_TILE).amax(1).tolist()
    out = []
    for i, s in enumerate(range(0, N, ROW_TILE)):
        idx = torch.arange(s, s + ROW_TILE, device=q_NHD.device).clamp_(max=N - 1)
        n = min(ROW_TILE, N - s)
        blocks = num_blocks if isinstance(num_blocks, int) else num_blocks[i]
        o = _attention_tile(q_NHD[idx], k_SHCD, v_SHCD, rows_N[idx], first_N[idx], last_N[idx], blocks, scale, hkv)
        out.append(o[:n])
    return torch.cat(out).to(q_NHD.dtype) if out else q_NHD.new_zeros(0, H, D)


def _attention_tile(q_THD: torch.Tensor, k_SHCD: torch.Tensor, v_SHCD: torch.Tensor, rows_T: torch.Tensor,
                    first_T: torch.Tensor, last_T: torch.Tensor, num_blocks: int, scale: float,
                    hkv: int) -> torch.Tensor:
    T, H, D = q_THD.shape
    q = q_THD.float().reshape(T, hkv, H // hkv, D)  # [T, Hkv, G, D]
    m = torch.full((T, hkv, H // hkv), float("-inf"), device=q.device)
    l_ = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    offs = torch.arange(KEY_BLOCK, device=q.device)
    for j in range(num_blocks):
        cols = first_T[:, None] + j * KEY_BLOCK + offs  # [T, B]
        ok = cols <= last_T[:, None]
        cols = torch.minimum(cols, last_T[:, None])
        k = k_SHCD[rows_T[:, None], :, cols].float().transpose(1, 2).contiguous()  # [T, Hkv, B, D]
        v = v_SHCD[rows_T[:, None], :, cols].float().transpose(1, 2).contiguous()
        s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [T, Hkv, G, B]
        s = s.masked_fill(~ok[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        l_ = l_ * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.matmul(p, v)
        m = m_new
    return (acc / l_[..., None]).reshape(T, H, D)


def _recompute_grads(fn: Callable[..., torch.Tensor], ctx, dy: torch.Tensor) -> list[torch.Tensor | None]:
    """Gradients of `fn` (an op's plain, not batch-invariant, form) at the saved inputs: one autograd pass over
    all rows. The saved tensors are the Function's first inputs, in order."""
    inputs = [t.detach().requires_grad_(need) for t, need in zip(ctx.saved_tensors, ctx.needs_input_grad)]
    wanted = [t for t in inputs if t.requires_grad]
    if not wanted:
        return [None] * len(inputs)
    with torch.enable_grad():
        grads = iter(torch.autograd.grad(fn(*inputs), wanted, dy))
    return [next(grads) if t.requires_grad else None for t in inputs]


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor,
                     scale: float | None, plain: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                     ) -> torch.Tensor:
    """The trainer's packed causal attention through `attention`: query [1, H, T, D], key/value [1, Hkv, T, D]
    (HF's layout), sequences at cu_seqlens `cu`; → [1, T, H, D]. Backward recomputes and differentiates
    `plain(query, key, value)`, the default packed attention of the same sequences (flash varlen on CUDA)."""
    return _PackedAttention.apply(query, key, value, cu, scale, plain)


class _PackedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor,
                scale: float | None, plain: Callable) -> torch.Tensor:
        ctx.save_for_backward(query, key, value)
        ctx.plain = plain
        return _packed_attention(query, key, value, cu, scale)

    @staticmethod
    @once_differentiable
    def backward(ctx, do: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (*_recompute_grads(ctx.plain, ctx, do), None, None, None)


def _packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu: torch.Tensor,
                      scale: float | None) -> torch.Tensor:
    T, dev = query.shape[2], query.device
    cu = cu.to(dev, torch.long)
    seq = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=dev), cu[1:] - cu[:-1], output_size=T)
    pos = torch.arange(T, device=dev)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    first = cu[:-1][seq]
    o = attention(query[0].transpose(0, 1), key, value, torch.zeros_like(pos), first, pos, None, scale)
    return o.unsqueeze(0)


# ------------------------------------------------------------------------------------------ the trainer's model
def _linear_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias)


def _norm_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, module.weight, module.variance_epsilon)


def install(model: nn.Module) -> int:
    """Route `model`'s nn.Linear and Llama-style RMSNorm forwards through the batch-invariant ops (instance-level,
    so FSDP2's hooks still run) and mark the model so its engine forward asks for `attention`. Idempotent;
    returns how many modules were patched."""
    patched = 0
    for mod in model.modules():
        if getattr(mod, "_hf_exact", False):
            continue
        if isinstance(mod, nn.Linear):
            mod.forward = functools.partial(_linear_forward, mod)
        elif type(mod).__name__.endswith("RMSNorm") and hasattr(mod, "variance_epsilon"):
            mod.forward = functools.partial(_norm_forward, mod)
        else:
            continue
        mod._hf_exact = True
        patched += 1
    model._hf_exact_logprobs = True
    logger.info("exact log-probs: %d Linear/RMSNorm modules use the batch-invariant ops", patched)
    return patched


def installed(model: nn.Module) -> bool:
    return bool(getattr(model, "_hf_exact_logprobs", False))
