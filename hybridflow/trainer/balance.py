"""Balance sequences across data-parallel ranks by token count before the stages run.

DP_COMPUTE_PROTO gives rank r the r-th contiguous chunk, so balancing is a reordering of the batch: a greedy
longest-first assignment to the least-loaded rank that still has room (every rank gets the same number of rows).
"""

from __future__ import annotations

import heapq

import torch


def balanced_order(seq_lens: torch.Tensor, world_size: int) -> torch.Tensor:
    """Row order such that consecutive `len / world_size` rows form partitions of near-equal token sums."""
    n = int(seq_lens.numel())
    if world_size <= 1 or n % world_size:
        return torch.arange(n)
    per_rank = n // world_size
    order = torch.argsort(seq_lens, descending=True, stable=True).tolist()
    heap = [(0, r) for r in range(world_size)]  # (tokens, rank)
    parts: list[list[int]] = [[] for _ in range(world_size)]
    lens = seq_lens.tolist()
    for i in order:
        tokens, r = heapq.heappop(heap)
        parts[r].append(i)
        if len(parts[r]) < per_rank:  # a full rank leaves the heap
            heapq.heappush(heap, (tokens + int(lens[i]), r))
    return torch.tensor([i for p in parts for i in sorted(p)], dtype=torch.long)

