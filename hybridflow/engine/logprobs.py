"""Per-token log-probs and entropy of chosen tokens from hidden states, in chunks over tokens.

Decision: the caller passes only the K hidden states that predict response tokens; each chunk of `chunk_size`
rows computes lm_head → fp32 logits / temperature → log-softmax, gathers the label and (optionally) the entropy,
and under autograd is recomputed in backward (activation checkpointing). So the fp32 [K, V] logits never exist:
peak extra memory is one [chunk, V] block, independent of the number of tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs(hidden_CH: torch.Tensor, weight_VH: torch.Tensor, bias_V: torch.Tensor | None,
                    labels_C: torch.Tensor, temperature: float, with_entropy: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    logits_CV = F.linear(hidden_CH, weight_VH, bias_V).float()
    if temperature != 1.0:
        logits_CV = logits_CV / temperature
    logz_C = torch.logsumexp(logits_CV, dim=-1)
    logp_C = logits_CV.gather(-1, labels_C.unsqueeze(-1)).squeeze(-1) - logz_C
    if not with_entropy:
        return logp_C, torch.zeros_like(logp_C)
    # H = -Σ p log p = logZ - Σ p·logit (finite logits; avoids a second [C, V] log-prob tensor).
    ent_C = logz_C - (torch.softmax(logits_CV, dim=-1) * logits_CV).sum(-1)
    return logp_C, ent_C


def chunked_logprobs(hidden_KH: torch.Tensor, head: torch.nn.Linear | torch.Tensor, labels_K: torch.Tensor, *,
                     temperature: float = 1.0, chunk_size: int = 1024, with_entropy: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) [K] (fp32) and entropy [K] or None, for hidden states [K, H] and an output head [V, H]."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1 (actor.logprob_chunk_size)")
    weight = head.weight if isinstance(head, torch.nn.Linear) else head
    bias = head.bias if isinstance(head, torch.nn.Linear) else None
    if hidden_KH.shape[0] == 0:
        empty = hidden_KH.new_zeros(0, dtype=torch.float32) + weight.sum() * 0  # keeps the graph connected
        return empty, (empty if with_entropy else None)
    use_ckpt = torch.is_grad_enabled() and (hidden_KH.requires_grad or weight.requires_grad)
    logps, ents = [], []
    for h, y in zip(hidden_KH.split(chunk_size), labels_K.split(chunk_size)):
        if use_ckpt:
            lp, ent = checkpoint(_chunk_logprobs, h, weight, bias, y, temperature, with_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(h, weight, bias, y, temperature, with_entropy)
        logps.append(lp)
        ents.append(ent)
    return torch.cat(logps), (torch.cat(ents) if with_entropy else None)
