"""DAPO dynamic sampling (`algorithm.filter_groups`): keep the prompt groups whose responses did not all score the
same, and generate more until a training batch is full or the generation budget is spent.

`InformativeGroups` is the bookkeeping every mode shares. Sync mode (`PPOAlgorithm._keep_informative_groups`)
adds one generation round of `data.train_batch_size` prompts at a time; the non-sync drivers
(`trainer/async_driver.py`) score each finished generate request as it arrives and add it, asking the rollout
workers for more prompts while the batch is short. The rules are the same: a batch is the first `target` kept rows
(surplus groups are discarded, as in the DAPO recipe); when the budget (`max_num_gen_batches` batches of prompts)
is spent short, it trains on the kept rows cut to whole groups on every rank, or, if none are left, on the last
`target` rows generated unfiltered.
"""

from __future__ import annotations

import logging

import numpy as np

from hybridflow.algorithms import filter_uninformative_groups
from hybridflow.protocol import DataProto, keys

logger = logging.getLogger(__name__)

_SUMMED = ("reward/errors", "reward/timeouts")  # counts; other reward metrics are means, maxima or minima


class InformativeGroups:
    """Scored rows in, informative groups kept until `target` rows (`n` responses per prompt, whole groups on
    each of `world_size` ranks)."""

    def __init__(self, target: int, n: int, world_size: int) -> None:
        self.target, self.n, self.world_size = target, n, world_size
        self.kept: list[DataProto] = []
        self.recent: list[DataProto] = []  # the newest unfiltered rows, at least `target` of them (the fallback)
        self.fractions: list[float] = []  # per added part: the fraction of its groups dropped
        self.rows = 0  # rows kept so far

    @property
    def full(self) -> bool:
        return self.rows >= self.target

    def add(self, batch: DataProto) -> None:
        """A scored part (`token_level_scores`, `uid`): keep its informative groups."""
        keep, frac = filter_uninformative_groups(batch.batch[keys.TOKEN_LEVEL_SCORES].sum(-1),
                                                 batch.non_tensor_batch[keys.UID])
        self.fractions.append(frac)
        kept = batch.select_idxs(keep)
        self.kept.append(kept)
        self.rows += len(kept)
        self.recent.append(batch)
        while sum(len(b) for b in self.recent[1:]) >= self.target:
            self.recent.pop(0)

    def batch(self, metrics: dict[str, float], gen_batches: float) -> DataProto:
        """The training batch; adds `data/frac_groups_filtered` (mean over the parts) and `data/gen_batches`."""
        metrics["data/frac_groups_filtered"] = float(np.mean(self.fractions))
        metrics["data/gen_batches"] = float(gen_batches)
        merged = DataProto.concat(self.kept)
        if len(merged) >= self.target:
            return merged[:self.target]
        logger.warning("dynamic sampling: %d informative samples after %.2g batches of prompts (wanted %d); "
                       "training on what there is", len(merged), gen_batches, self.target)
        unit = self.n * self.world_size
        usable = (len(merged) // unit) * unit
        if usable:
            return merged[:usable]
        recent = DataProto.concat(self.recent)
        return recent[max(0, len(recent) - self.target):]


def combine_reward_metrics(parts: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """The reward stage's metrics over several scored parts of (rows, metrics): counts summed, `*/max` and
    `*/min` taken over the parts, every other metric (means and fractions) weighted by rows."""
    out: dict[str, float] = {}
    for key in {k for _, m in parts for k in m}:
        vals = [(rows, m[key]) for rows, m in parts if key in m]
        if key in _SUMMED:
            out[key] = float(sum(v for _, v in vals))
        elif key.endswith("/max"):
            out[key] = float(max(v for _, v in vals))
        elif key.endswith("/min"):
            out[key] = float(min(v for _, v in vals))
        else:
            total = sum(r for r, _ in vals)
            out[key] = float(sum(r * v for r, v in vals) / total) if total else float(np.mean([v for _, v in vals]))
    return out
