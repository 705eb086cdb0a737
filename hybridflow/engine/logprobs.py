"""Per-token log-probs and entropy of chosen tokens from hidden states, in chunks over tokens.

Decision: the caller passes only the K hidden states that predict response tokens; one autograd Function loops over
chunks of `chunk_size` rows. Forward runs the lm_head GEMM in the input dtype and one fused reduction per chunk,
saving only [K] fp32 stats (logZ, entropy). Backward recomputes each chunk's logits, builds d logits in one fused
pass and accumulates d weight with `addmm_` into one [V, H] buffer. The fused pieces are plain torch functions
(fp32 math on load), `torch.compile`d on CUDA. Peak extra memory: one [chunk, V] block (+ its d logits), never [K, V].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from hybridflow.engine import invariant
from hybridflow.utils.compile import GuardedCompile

# K: tokens, C: rows of one chunk, H: hidden size, V: vocab.


def logit_stats(logits_CV: torch.Tensor, labels_C: torch.Tensor, temperature: float, with_entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log p(label), logZ, entropy or None) [C] fp32 of softmax(logits / temperature) — one pass for inductor."""
    z_CV = logits_CV.float() / temperature
    max_C1 = z_CV.amax(-1, keepdim=True)
    exp_CV = torch.exp(z_CV - max_C1)
    sum_C = exp_CV.sum(-1)
    logz_C = max_C1.squeeze(-1) + torch.log(sum_C)
    logp_C = z_CV.gather(-1, labels_C.unsqueeze(-1)).squeeze(-1) - logz_C
    if not with_entropy:
        return logp_C, logz_C, None
    # H = logZ - Σ p·z (finite logits; avoids a [C, V] log-prob tensor).
    return logp_C, logz_C, logz_C - (exp_CV * z_CV).sum(-1) / sum_C


def dlogits(logits_CV: torch.Tensor, labels_C: torch.Tensor, logz_C: torch.Tensor, dlogp_C: torch.Tensor,
            temperature: float, ent_C: torch.Tensor | None = None, dent_C: torch.Tensor | None = None
            ) -> torch.Tensor:
    """d loss / d logits [C, V] in the logits' dtype, given d loss / d log p(label) and (optionally) / d entropy.

    With z = logits / T and p = softmax(z): d log p_y / d z_j = 1[j = y] - p_j and d H / d z_j = -p_j (log p_j + H).
    """
    z_CV = logits_CV.float() / temperature
    logp_CV = z_CV - logz_C.unsqueeze(-1)
    p_CV = torch.exp(logp_CV)
    coef_CV = dlogp_C.unsqueeze(-1)
    if dent_C is not None:
        coef_CV = coef_CV + dent_C.unsqueeze(-1) * (logp_CV + ent_C.unsqueeze(-1))
    dz_CV = -p_CV * coef_CV
    is_label_CV = torch.arange(logits_CV.shape[-1], device=logits_CV.device) == labels_C.unsqueeze(-1)
    dz_CV = torch.where(is_label_CV, dz_CV + dlogp_C.unsqueeze(-1), dz_CV)
    return (dz_CV / temperature).to(logits_CV.dtype)


_COMPILED = (GuardedCompile(logit_stats, "the log-prob statistics"), GuardedCompile(dlogits, "the log-prob d logits"))


def _kernels(device: torch.device) -> tuple[Callable, Callable]:
    """Inductor fuses each piece into one or two kernels over the bf16 block on CUDA; CPU (CI) runs them eagerly."""
    return _COMPILED if device.type == "cuda" else (logit_stats, dlogits)


def _forward(hidden_KH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None, labels_K: torch.Tensor,
             temperature: float, chunk_size: int, with_entropy: bool, exact: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    stats = _kernels(hidden_KH.device)[0]
    if exact:  # the rollout's bits for log p(label) (engine/invariant.py); logZ / entropy as usual, for backward
        temp = torch.tensor(temperature, dtype=torch.float32, device=hidden_KH.device)
        out = [(invariant.token_logprobs(z_CV, y_C, temp), *stats(z_CV, y_C, temperature, with_entropy)[1:])
               for h_CH, y_C in zip(hidden_KH.split(chunk_size), labels_K.split(chunk_size))
               for z_CV in [invariant.linear(h_CH, weight_VH, bias_V)]]
    else:
        out = [stats(F.linear(h_CH, weight_VH, bias_V), y_C, temperature, with_entropy)
               for h_CH, y_C in zip(hidden_KH.split(chunk_size), labels_K.split(chunk_size))]
    logp_K, logz_K = torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])
    return logp_K, logz_K, (torch.cat([o[2] for o in out]) if with_entropy else None)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_KH, weight_VH, bias_V, labels_K, temperature, chunk_size, with_entropy, exact):
        logp_K, logz_K, ent_K = _forward(hidden_KH, weight_VH, bias_V, labels_K, temperature, chunk_size,
                                         with_entropy, exact)
        ctx.save_for_backward(hidden_KH, weight_VH, bias_V, labels_K, logz_K, ent_K)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.set_materialize_grads(False)  # an unused entropy arrives as None: its [C, V] term is skipped
        if ent_K is None:
            ent_K = logp_K.new_empty(0)
            ctx.mark_non_differentiable(ent_K)
        return logp_K, ent_K

    @staticmethod
    @once_differentiable
    def backward(ctx, dlogp_K, dent_K):
        hidden_KH, weight_VH, bias_V, labels_K, logz_K, ent_K = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        if dlogp_K is None and (dent_K is None or ent_K is None):
            return None, None, None, None, None, None, None, None
        dlogp_K = torch.zeros_like(logz_K) if dlogp_K is None else dlogp_K
        dent_K = None if ent_K is None else dent_K
        dlogits_fn, C = _kernels(hidden_KH.device)[1], ctx.chunk_size
        dhidden_KH = torch.empty(hidden_KH.shape, dtype=hidden_KH.dtype, device=hidden_KH.device) if need_h else None
        dweight_VH = None
        dbias_V = torch.zeros(weight_VH.shape[0], dtype=torch.float32, device=weight_VH.device) if need_b else None
        for s in range(0, hidden_KH.shape[0], C):
            h_CH = hidden_KH[s:s + C]
            dlogits_CV = dlogits_fn(F.linear(h_CH, weight_VH, bias_V), labels_K[s:s + C], logz_K[s:s + C],
                                    dlogp_K[s:s + C], ctx.temperature,
                                    None if dent_K is None else ent_K[s:s + C],
                                    None if dent_K is None else dent_K[s:s + C])
            if need_h:
                torch.mm(dlogits_CV, weight_VH, out=dhidden_KH[s:s + C])
            if need_w:  # one [V, H] buffer, accumulated in the GEMM's epilogue (beta=1)
                dweight_VH = dlogits_CV.T @ h_CH if dweight_VH is None else dweight_VH.addmm_(dlogits_CV.T, h_CH)
            if need_b:
                dbias_V += dlogits_CV.sum(0, dtype=torch.float32)
        dbias_V = None if dbias_V is None else dbias_V.to(bias_V.dtype)
        return dhidden_KH, dweight_VH, dbias_V, None, None, None, None, None


def chunked_logprobs(hidden_KH: torch.Tensor, head: torch.nn.Linear | torch.Tensor, labels_K: torch.Tensor, *,
                     temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False,
                     exact: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) [K] (fp32) and entropy [K] or None, for hidden states [K, H] and an output head [V, H].
    `exact`: log p(label) through the batch-invariant ops (the rollout engine's bits; backward unchanged)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1 (actor.logprob_chunk_size)")
    weight = head.weight if isinstance(head, torch.nn.Linear) else head
    bias = head.bias if isinstance(head, torch.nn.Linear) else None
    if hidden_KH.shape[0] == 0:
        empty = hidden_KH.new_zeros(0, dtype=torch.float32) + weight.sum() * 0  # keeps the graph connected
        return empty, (empty if with_entropy else None)
    needs_grad = any(t is not None and t.requires_grad for t in (hidden_KH, weight, bias))
    if not (torch.is_grad_enabled() and needs_grad):
        logp_K, _, ent_K = _forward(hidden_KH, weight, bias, labels_K, float(temperature), chunk_size, with_entropy,
                                    exact)
        return logp_K, ent_K
    logp_K, ent_K = _ChunkedLogprobs.apply(hidden_KH, weight, bias, labels_K, float(temperature), chunk_size,
                                           with_entropy, exact)
    return logp_K, (ent_K if with_entropy else None)
