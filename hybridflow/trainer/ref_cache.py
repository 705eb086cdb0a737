"""`ReferenceLogps`: the reference model's per-token response log-probs of every preference pair, computed in one
first pass (`dpo.precompute_ref=true`) so the reference model can be freed before training.

Decision: rows are keyed by (dataset index, side) and stored unpadded (the pair's response tokens only), so a
lookup rebuilds exactly the `ref_log_prob` [B, R] layout of any later batch, however it was shuffled or padded —
a pair's tokens never depend on its batch (`split_pair`). Legend: B rows, R response width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from hybridflow.protocol import DataProto, keys


def _keys(batch: DataProto) -> list[tuple[int, int]]:
    index = batch.non_tensor_batch["pair_index"].tolist()
    side = batch.batch["pair_chosen"].tolist()
    return [(int(i), int(s)) for i, s in zip(index, side)]


class ReferenceLogps:
    def __init__(self) -> None:
        self._rows: dict[tuple[int, int], torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, batch: DataProto, ref_logp_BR: torch.Tensor) -> None:
        lengths = batch.batch[keys.RESPONSE_MASK].sum(-1).tolist()
        for row, (key, n) in enumerate(zip(_keys(batch), lengths)):
            self._rows[key] = ref_logp_BR[row, : int(n)].detach().cpu().clone()

    def lookup(self, batch: DataProto) -> torch.Tensor:
        """`ref_log_prob` [B, R] of `batch` (0 on padding)."""
        mask = batch.batch[keys.RESPONSE_MASK]
        out: torch.Tensor | None = None
        for row, key in enumerate(_keys(batch)):
            logp = self._rows.get(key)
            if logp is None:
                raise KeyError(f"no precomputed reference log-probs for pair {key[0]} ({'chosen' if key[1] else 'rejected'}); "
                               "the precompute pass covers the training and validation sets it was given")
            if out is None:
                out = torch.zeros(mask.shape, dtype=logp.dtype)
            out[row, : len(logp)] = logp
        assert out is not None, "lookup of an empty batch"
        return out

    @classmethod
    def compute(cls, batches: Iterable[DataProto], ref_fn: Callable[[DataProto], DataProto]) -> ReferenceLogps:
        """One pass: `ref_fn(batch).batch["ref_log_prob"]` for every batch."""
        cache = cls()
        for batch in batches:
            cache.add(batch, ref_fn(batch).batch[keys.REF_LOG_PROB])
        return cache
