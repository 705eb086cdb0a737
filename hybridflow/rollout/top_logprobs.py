"""The alternatives of the agent endpoint's `top_logprobs`: one causal forward without the KV cache over a finished
completion's whole sequence, with the rollout's weights.

The decode loop keeps only each sampled token's log-prob (holding a [steps, V] distribution per slot for the few
requests that ask would cost every step), so a request with `top_logprobs` pays one extra forward instead. Values are
log-probs under softmax(logits / temperature), before top-k / top-p, and agree with the decode's `logprob` to ~1e-4
(the same weights through other kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.rollout.forward import mlp_block, qkv, rms_norm, scaled
from hybridflow.rollout.model_runner import ModelRunner


@torch.no_grad()
def top_logprobs(runner: ModelRunner, ids: list[int], n_sampled: int, k: int, temperature: float
                 ) -> list[list[tuple[int, float]]]:
    """For each of the last `n_sampled` ids of `ids`: the k most likely ids at its position and their log-probs."""
    w, spec, dev = runner.weights, runner.spec, runner.device
    heads, group = (spec.num_heads, spec.num_kv_heads, spec.head_dim), spec.num_heads // spec.num_kv_heads
    ids_1L = torch.tensor([ids], dtype=torch.long, device=dev)
    pos_1L = torch.arange(len(ids), device=dev)[None]
    x = scaled(F.embedding(ids_1L, w.embed), spec.embed_scale)
    for lw, (cos, sin) in zip(w.layers, runner.rope.at(pos_1L)):
        q, kk, v = (t.transpose(1, 2) for t in qkv(x, lw, cos, sin, heads, spec.eps))  # [1, heads, L, D]
        o = F.scaled_dot_product_attention(q, kk.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                                           is_causal=True, scale=spec.attn_scale)
        x = mlp_block(x, o.transpose(1, 2).flatten(-2), lw, spec.eps)
    before = x[0, len(ids) - n_sampled - 1: len(ids) - 1]  # the positions that predicted the sampled ids
    logits_NV = F.linear(rms_norm(before, w.norm, spec.eps), w.lm_head).float() / temperature
    vals, idx = torch.log_softmax(logits_NV, dim=-1).topk(k, dim=-1)
    return [list(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
