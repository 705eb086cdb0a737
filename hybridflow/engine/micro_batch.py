"""Split a (mini-)batch into micro-batches: a fixed number of samples, or a token budget with balanced loads.

Decision: dynamic micro-batches use the fewest micro-batches whose balanced split fits the budget
(longest-processing-time greedy), and the count is the max over data-parallel ranks so every rank runs the same
number of forward/backward passes (FSDP collectives must match). Results are index lists into the batch.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

import torch
import torch.distributed as dist


def fixed_micro_batches(num_samples: int, micro_batch_size: int) -> list[list[int]]:
    """Contiguous groups of `micro_batch_size` samples (the last may be smaller)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} must be >= 1")
    return [list(range(s, min(s + micro_batch_size, num_samples))) for s in range(0, num_samples, micro_batch_size)]


def balanced_partition(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Split indices into `k` non-empty groups with near-equal length sums (LPT greedy); groups keep index order."""
    if not 1 <= k <= len(lengths):
        raise ValueError(f"cannot split {len(lengths)} sequences into {k} non-empty micro-batches")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = [[] for _ in range(k)]
    # Ties on load go to the group with fewer items, so the first k items seed every group (none stays empty).
    heap = [(0, 0, g) for g in range(k)]
    for i in order:
        load, count, g = heapq.heappop(heap)
        groups[g].append(i)
        heapq.heappush(heap, (load + lengths[i], count + 1, g))
    return [sorted(g) for g in groups]


def _max_over_ranks(value: int, group: dist.ProcessGroup | None) -> int:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def token_budget_micro_batches(lengths: Sequence[int], max_tokens: int,
                               group: dist.ProcessGroup | None = None) -> list[list[int]]:
    """Balanced micro-batches of at most `max_tokens` tokens each (same count on every rank of `group`)."""
    if max_tokens < 1:
        raise ValueError(f"max_token_len_per_gpu={max_tokens} must be >= 1")
    longest = max(lengths, default=0)
    if longest > max_tokens:
        raise ValueError(f"a sequence of {longest} tokens exceeds the token budget max_token_len_per_gpu="
                         f"{max_tokens}; raise it to at least max_prompt_length + max_response_length")
    n = len(lengths)
    k = max(1, math.ceil(sum(lengths) / max_tokens))
    while k < n:
        parts = balanced_partition(lengths, k)
        if max(sum(lengths[i] for i in p) for p in parts) <= max_tokens:
            break
        k += 1
    k = min(_max_over_ranks(min(k, n), group), n)
    return balanced_partition(lengths, k)
