"""A dataloader whose position survives checkpoints: `StatefulDataLoader` + `make_dataloader`.

The order of an epoch is a pure function of (seed, epoch) — a `torch.randperm` — so the saved state is only
(epoch, batches consumed). Batches are counted when *yielded* to the caller, never when prefetched by workers, so
resume continues with the next unseen batch; a state saved after an epoch's last batch resumes at the next epoch.
Tokenisation runs in `__getitem__`, i.e. in the torch DataLoader workers when `data.num_workers > 0`.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from hybridflow.data.collate import collate_rl
from hybridflow.protocol import DataProto, keys

if TYPE_CHECKING:
    from hybridflow.config.schema import DataConfig

logger = logging.getLogger(__name__)


class ResumableBatchSampler:
    """Index batches of one epoch, starting at batch `start`; `epoch`/`start` are set by the loader."""

    def __init__(self, num_samples: int, batch_size: int, shuffle: bool, seed: int, drop_last: bool) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}: must be >= 1")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch, self.start = 0, 0

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        gen = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=gen).tolist()

    def batches(self, epoch: int) -> list[list[int]]:
        order = self.order(epoch)
        return [order[i * self.batch_size:(i + 1) * self.batch_size] for i in range(len(self))]

    def __len__(self) -> int:
        div = self.num_samples // self.batch_size if self.drop_last else math.ceil(self.num_samples / self.batch_size)
        return div

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.batches(self.epoch)[self.start:]


class StatefulDataLoader:
    """Iterating gives the (rest of the) current epoch as DataProto batches; `len()` = batches per epoch.

    `state_dict()` → {epoch, batch_in_epoch, ...}; `load_state_dict()` makes the next iteration continue with the
    first batch not yet yielded. `uid` is set per prompt as "<dataset name>-e<epoch>-<row index>".
    """

    def __init__(self, dataset: Dataset, batch_size: int, *, shuffle: bool = True, drop_last: bool = True,
                 seed: int = 0, num_workers: int = 0, prefetch_factor: int | None = None,
                 persistent_workers: bool = False, collate_fn: Callable[[list[Any]], DataProto] | None = None,
                 name: str | None = None) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        self.sampler = ResumableBatchSampler(n, batch_size, shuffle, seed, drop_last)
        if len(self.sampler) == 0:
            raise ValueError(f"batch_size={batch_size} with drop_last=true gives no batch from {n} samples; lower "
                             "data.train_batch_size (or data.val_batch_size) or set data.drop_last=false")
        if collate_fn is None:
            collate_fn = getattr(dataset, "collate", None) or functools.partial(collate_rl, pad_token_id=0)
        self.name = name or getattr(dataset, "name", "data")
        self.dataset = dataset
        kwargs: dict[str, Any] = {}
        if num_workers > 0:
            kwargs = {"prefetch_factor": prefetch_factor, "persistent_workers": persistent_workers}
        elif persistent_workers or prefetch_factor is not None:
            logger.warning("data.prefetch_factor / data.persistent_workers are ignored with data.num_workers=0")
        self._loader = DataLoader(dataset, batch_sampler=self.sampler, num_workers=num_workers,
                                  collate_fn=collate_fn, **kwargs)
        self.epoch, self.batch_in_epoch = 0, 0

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def num_rows(self) -> int:
        """Rows of the dataset (an epoch's batches hold them all, less a dropped last partial batch)."""
        return self.sampler.num_samples

    @property
    def batch_size(self) -> int:
        return self.sampler.batch_size

    def __iter__(self) -> Iterator[DataProto]:
        if self.batch_in_epoch >= len(self):
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        self.sampler.epoch, self.sampler.start = self.epoch, self.batch_in_epoch
        epoch = self.epoch
        for batch in self._loader:
            if "index" in batch.non_tensor_batch:
                batch.non_tensor_batch[keys.UID] = np.array(
                    [f"{self.name}-e{epoch}-{i}" for i in batch.non_tensor_batch["index"]], dtype=object)
            batch.meta_info.update(epoch=epoch, batch_in_epoch=self.batch_in_epoch)
            self.batch_in_epoch += 1
            yield batch
        if self.epoch == epoch and self.batch_in_epoch >= len(self):
            self.epoch, self.batch_in_epoch = epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch, "seed": self.sampler.seed,
                "num_samples": self.sampler.num_samples, "batch_size": self.sampler.batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "batch_size", "seed"):
            saved, now = state.get(key), getattr(self.sampler, key)
            if saved is not None and saved != now:
                logger.warning("dataloader state was saved with %s=%s but now %s=%s; the resumed order differs",
                               key, saved, key, now)
        self.epoch, self.batch_in_epoch = int(state["epoch"]), int(state["batch_in_epoch"])


def make_dataloader(dataset: Dataset, data_cfg: DataConfig, batch_size: int | None, shuffle: bool,
                    drop_last: bool, *, seed: int | None = None, name: str | None = None) -> StatefulDataLoader:
    """A StatefulDataLoader with the worker knobs of `data_cfg` (a DataConfig); batch_size None = whole dataset;
    `seed` (default data.seed) shuffles, `name` (default the dataset's) prefixes the group uids."""
    size = len(dataset) if batch_size is None else batch_size  # type: ignore[arg-type]
    return StatefulDataLoader(dataset, size, shuffle=shuffle, drop_last=drop_last,
                              seed=data_cfg.seed if seed is None else seed, num_workers=data_cfg.num_workers,
                              prefetch_factor=data_cfg.prefetch_factor,
                              persistent_workers=data_cfg.persistent_workers, name=name)


@dataclass(frozen=True)
class DataPosition:
    """Where the dataloader resumes: `batch` batches of epoch `epoch` were consumed. A save taken after the last
    batch of an epoch normalises to (epoch + 1, 0), so resuming at an epoch boundary trains the remaining epochs."""

    epoch: int
    batch: int

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    @classmethod
    def from_dict(cls, d: dict[str, Any], steps_per_epoch: int) -> DataPosition:
        return cls(int(d["epoch"]), int(d["batch"])).normalized(steps_per_epoch)

    def normalized(self, steps_per_epoch: int) -> DataPosition:
        """Carry whole epochs: (e, steps_per_epoch) → (e + 1, 0) — the epoch-boundary resume fix."""
        if steps_per_epoch < 1:
            raise ValueError(f"steps_per_epoch={steps_per_epoch}: must be >= 1 (is the dataset empty?)")
        extra, batch = divmod(self.batch, steps_per_epoch)
        return DataPosition(self.epoch + extra, batch)

