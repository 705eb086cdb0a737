"""Online DPO's pairing: from each prompt's sampled responses, the best- and worst-scored one form a
(chosen, rejected) pair; groups whose scores are all equal give no preference and are skipped (counted).

Decision: ties for the best (or the worst) go to the first such response in batch order, so pairing is a pure
function of the scores and the batch order (resumed and uninterrupted runs pair identically). Groups are taken in
the order of their first response.
Legend: B responses (prompts × rollout.n), P pairs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Pairs:
    chosen_P: torch.Tensor  # row index (into the B responses) of each pair's best response
    rejected_P: torch.Tensor  # row index of its worst response
    num_groups: int  # prompts seen
    tied_groups: int  # prompts skipped: every response scored the same (or the prompt had a single response)

    @property
    def num_pairs(self) -> int:
        return len(self.chosen_P)

    def interleaved(self) -> torch.Tensor:
        """Row indices chosen_0, rejected_0, chosen_1, ... (the layout the preference loss reads)."""
        return torch.stack([self.chosen_P, self.rejected_P], dim=1).reshape(-1)


def best_worst_pairs(scores_B: torch.Tensor, uid_B: Sequence | np.ndarray, atol: float = 0.0) -> Pairs:
    """One (best, worst) pair per group of `uid_B`; a group is tied when max - min <= `atol`."""
    if scores_B.ndim != 1 or len(scores_B) != len(uid_B):
        raise ValueError(f"scores must be one value per response ([B]) matching the {len(uid_B)} uids, got shape "
                         f"{tuple(scores_B.shape)}")
    groups: dict[object, list[int]] = {}
    for i, uid in enumerate(np.asarray(uid_B, dtype=object).tolist()):
        groups.setdefault(uid, []).append(i)
    scores = scores_B.double().tolist()
    chosen, rejected, tied = [], [], 0
    for rows in groups.values():
        vals = [scores[i] for i in rows]
        hi, lo = max(vals), min(vals)
        if len(rows) < 2 or hi - lo <= atol:
            tied += 1
            continue
        chosen.append(rows[vals.index(hi)])
        rejected.append(rows[vals.index(lo)])
    as_t = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return Pairs(as_t(chosen), as_t(rejected), len(groups), tied)
