"""The rollout's forward under `actor_rollout.exact_logprobs`: prefill, decode and multi-turn extension as one
flat batch of tokens through the batch-invariant ops (engine/invariant.py), so every token's logits — and the
sampled token's log-prob — have the bits the trainer's packed forward computes for it.

Decision: one function for the three cases. Token i sits at cache slot `slot[i]`, column `col[i]`, and attends to
that slot's columns [start[i], col[i]] (its sequence from the first real token); its K/V are written before the
layer attends, so a prompt's or an extension's tokens see each other causally. The ops are the HF module's, op for
op: the q/k/v and gate/up GEMMs the module runs (separate ones; Phi-3's fused matrices), RoPE from the same table in
the activation dtype, residual adds in the activation dtype. Eager; CUDA graphs can capture it (no host sync).
Where the weights hold fused [q; k; v] / [gate; up] copies of separate modules, the Triton GEMM runs each as one
launch with the parts' tile width (`invariant.split_linear`: the parts' bits); the CPU torch loop keeps one GEMM per
part (its GEMM may round a row's outputs differently for another N).

Legend: N tokens, S returned rows, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.engine import invariant
from hybridflow.rollout.forward import RopeTable, apply_rope
from hybridflow.rollout.kv_cache import KVCache
from hybridflow.rollout.weights import ArchSpec, ModelWeights


def unsupported(w: ModelWeights, spec: ArchSpec | None = None) -> str | None:
    """Why exact mode cannot run these weights, or None."""
    if any(lw.moe is not None for lw in w.layers):
        return "MoE layers (the expert dispatch has no batch-invariant form here)"
    if any(lw.post_attn_norm is not None or lw.gelu_tanh for lw in w.layers) or (
            spec is not None and (spec.attn_scale is not None or spec.embed_scale is not None)):
        return "Gemma-style layers (post-norms, GELU, scaled embeddings: the invariant forward is Llama-shaped)"
    return None


def forward_tokens(w: ModelWeights, spec: ArchSpec, rope: RopeTable, ids_N: torch.Tensor, pos_N: torch.Tensor,
                   slot_N: torch.Tensor, col_N: torch.Tensor, start_N: torch.Tensor, last_S: torch.Tensor,
                   cache: KVCache, max_keys: int | None = None) -> torch.Tensor:
    """Logits [S, V] of tokens `last_S` after running the N tokens (see module docstring). `max_keys` bounds every
    token's key count col - start + 1 and sets the number of key blocks (any bound gives the same bits; static for
    a CUDA graph); None = each query tile's own need, read from the device once."""
    N = ids_N.shape[0]
    h, hkv, d, eps = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.eps
    blocks = None if max_keys is None else -(-max_keys // invariant.KEY_BLOCK)
    x = F.embedding(ids_N, w.embed)
    cos, sin = rope.cos[pos_N].unsqueeze(-2), rope.sin[pos_N].unsqueeze(-2)
    for layer, lw in enumerate(w.layers):
        xn = invariant.rms_norm(x, lw.ln1, eps)
        q, k, v = _project(xn, lw.qkv, lw.qkv_bias, (lw.q, lw.k, lw.v), (lw.q_bias, lw.k_bias, lw.v_bias),
                           spec.fused_proj)
        q, k, v = q.view(N, h, d), k.view(N, hkv, d), v.view(N, hkv, d)
        if lw.q_norm is not None:
            q, k = invariant.rms_norm(q, lw.q_norm, eps), invariant.rms_norm(k, lw.k_norm, eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kc, vc = cache.k[layer], cache.v[layer]
        kc[slot_N, :, col_N] = k
        vc[slot_N, :, col_N] = v
        o = invariant.attention(q, kc, vc, slot_N, start_N, col_N, blocks, d ** -0.5)
        x = x + invariant.linear(o.reshape(N, -1), lw.o, lw.o_bias)
        xn = invariant.rms_norm(x, lw.ln2, eps)
        gate, up = _project(xn, lw.gate_up, None, (lw.gate, lw.up), (None, None), spec.fused_proj)
        act = F.silu(gate) * up
        x = x + invariant.linear(act, lw.down)
    return invariant.linear(invariant.rms_norm(x[last_S], w.norm, eps), w.lm_head)


def _project(xn: torch.Tensor, fused: torch.Tensor | None, fused_bias: torch.Tensor | None,
             parts: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...],
             module_fused: bool) -> tuple[torch.Tensor, ...]:
    """The parts' projections of xn with the trainer's bits: the module's own fused GEMM (Phi-3), one launch of
    the fused copy where that gives each part its own GEMM's bits, else one GEMM per part."""
    sizes = [p.shape[0] for p in parts]
    if module_fused:
        assert fused is not None, "weights of a fused-projection module without their fused matrix"
        return invariant.linear(xn, fused, fused_bias).split(sizes, dim=-1)
    whole_bias = fused_bias is not None or all(b is None for b in biases)
    if fused is not None and whole_bias and invariant.fusable(xn, sizes):
        return invariant.split_linear(xn, fused, fused_bias, sizes)
    return tuple(invariant.linear(xn, p, b) for p, b in zip(parts, biases))
