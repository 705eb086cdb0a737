"""`SupervisedTrainer`: the driver loop shared by SFT and reward-model training (and DPO later).

A subclass says which datasets, collate function, engine spec/head/loss and validation reduction it uses; this base
runs the loop: resume → (validate) → steps of one `train_batch` call each → validation every `trainer.test_freq`
→ checkpoints through `CheckpointManager` every `trainer.checkpoint.save_freq` → HF export at the end.
The engine spec is derived from the section (`sft`/`rm`, see `workers/engine_specs.py`) without touching the
user's config.
"""

from __future__ import annotations

import functools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.data import Dataset

from hybridflow.config import Config
from hybridflow.protocol import DataProto

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hybridflow.data.dataloader import StatefulDataLoader
    from hybridflow.engine import EngineSpec, HeadRequest
    from hybridflow.tracking import Tracker
    from hybridflow.trainer.supervised_worker import SupervisedGroup

logger = logging.getLogger(__name__)


def mean_metrics(per_rank: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Average each metric over the ranks (the engine already reduced them over ranks: `loss` is the whole-batch
    loss on every rank) and namespace bare engine keys as `<prefix>/<key>`."""
    keys = sorted({k for m in per_rank for k in m})
    out = {}
    for k in keys:
        vals = [m[k] for m in per_rank if k in m]
        out[k if "/" in k else f"{prefix}/{k}"] = float(sum(vals) / len(vals))
    return out


class SupervisedTrainer(ABC):
    section: str = ""  # "sft" | "rm": the config section with epochs, batch_size, optim, export_dir, ...
    loss: str = ""  # SUPERVISED_LOSSES name

    def __init__(self, cfg: Config, *, tokenizer: PreTrainedTokenizerBase | None = None,
                 tracker: Tracker | None = None) -> None:
        from hybridflow.models.loader import load_tokenizer

        self.cfg = cfg
        self.sec = getattr(cfg, self.section)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        self.train_ds, self.val_ds = self.build_datasets()
        self.world_size = self._world_size()
        self._check_batch_size()
        self.loader = self._loader(self.train_ds, shuffle=cfg.data.shuffle, drop_last=True)
        if len(self.loader) == 0:
            raise ValueError(f"{self.section}.batch_size={self.sec.batch_size} is larger than the training set "
                             f"({len(self.train_ds)} rows): lower {self.section}.batch_size or add data")
        self.total_steps = self.sec.total_steps or len(self.loader) * self.sec.epochs
        self.tracker = tracker
        self.global_step = 0
        self.history: list[dict[str, float]] = []
        self.group = self._build_group()

    # ----------------------------------------------------------------------------------------- subclass API
    @abstractmethod
    def build_datasets(self) -> tuple[Dataset, Dataset | None]: ...

    @abstractmethod
    def collate_fn(self) -> Callable[[list[Any]], DataProto]: ...

    @abstractmethod
    def engine_spec(self) -> EngineSpec:
        """The engine this trainer trains (`workers/engine_specs.py`: the section mapped onto an EngineSpec)."""

    @abstractmethod
    def train_head(self) -> HeadRequest:
        """What the loss reads from the engine (log-probs for SFT, values for a reward model)."""

    def model_path(self) -> str | None:
        """Where the model starts from (None = `model.path`, else `model.preset`)."""
        return None

    @abstractmethod
    def validate(self) -> dict[str, float]: ...

    def loss_kwargs(self) -> dict[str, Any]:
        return {}

    def reached_target(self, metrics: dict[str, float]) -> bool:
        """True when the validation `metrics` meet the section's stop criterion (none by default)."""
        return False

    def missed_target(self) -> None:  # noqa: B027 - optional hook: sections without a target do nothing
        """Called when `total_steps` ran out before `reached_target` held (only for sections with a target)."""

    # ----------------------------------------------------------------------------------------------- build
    def _world_size(self) -> int:
        from hybridflow.config.resolved import process_on_nodes

        return sum(process_on_nodes(self.cfg))

    def _check_batch_size(self) -> None:
        b, w = self.sec.batch_size, self.world_size
        if b % w:
            raise ValueError(f"{self.section}.batch_size={b} must be divisible by the {w} data-parallel ranks "
                             f"(trainer.nnodes × trainer.n_gpus_per_node); use e.g. {max(w, b // w * w)}")

    def _loader(self, ds: Dataset, shuffle: bool, drop_last: bool) -> StatefulDataLoader:
        from hybridflow.data.dataloader import StatefulDataLoader

        d = self.cfg.data
        return StatefulDataLoader(ds, self.sec.batch_size, shuffle=shuffle, drop_last=drop_last, seed=d.seed,
                                  num_workers=d.num_workers, prefetch_factor=d.prefetch_factor,
                                  persistent_workers=d.persistent_workers, collate_fn=self.collate_fn())

    def _build_group(self) -> SupervisedGroup:
        from hybridflow.controller import ResourcePool, WorkerGroup
        from hybridflow.trainer.supervised_worker import SupervisedGroup, SupervisedWorker

        worker = functools.partial(SupervisedWorker, self.cfg, self.engine_spec(), self.train_head(), self.loss,
                                   self.loss_kwargs())
        pool = ResourcePool.from_config(self.cfg)
        self.pool = pool
        group = SupervisedGroup(WorkerGroup(pool, worker, backend=self.cfg.trainer.backend, name=f"{self.section}"))
        group.init_model()
        return group

    # ----------------------------------------------------------------------------------------------- loop
    def fit(self) -> list[dict[str, float]]:
        """Train `total_steps` optimizer steps; returns the logged metrics of every step."""
        t = self.cfg.trainer
        self._resume()
        if t.val_before_train and self.val_ds is not None and self.global_step == 0:
            self._log(self.validate(), step=0)
        for batch in self._batches():
            self.global_step += 1
            start = time.perf_counter()
            metrics = mean_metrics(self.group.train_batch(batch), self.section)
            metrics["timing/step"] = time.perf_counter() - start
            is_last = self.global_step >= self.total_steps
            validated = self.val_ds is not None and (is_last or (t.test_freq > 0 and self.global_step % t.test_freq == 0))
            if validated:
                metrics |= self.validate()
            done = validated and self.reached_target(metrics)
            self._log(metrics, step=self.global_step)
            self._maybe_save(is_last or done)
            if done:
                logger.info("%s: stop criterion met at step %d of at most %d", self.section, self.global_step,
                            self.total_steps)
                break
            if is_last:
                self.missed_target()
                break
        return self.history

    def _batches(self) -> Iterator[DataProto]:
        while True:  # cycle epochs until total_steps (which may be set beyond the epochs)
            yield from self.loader

    def _log(self, metrics: dict[str, float], step: int) -> None:
        metrics = {"training/global_step": float(step), **metrics}
        self.history.append(metrics)
        if self.tracker is not None:
            self.tracker.log(metrics, step=step)
        else:
            logger.info("%s step %d: %s", self.section, step,
                        ", ".join(f"{k}={v:.4g}" for k, v in metrics.items() if k != "training/global_step"))

    # ---------------------------------------------------------------------------------------- checkpoints
    def _maybe_save(self, is_last: bool) -> None:
        ck = self.cfg.trainer.checkpoint
        if ck.save_freq == 0 or not (is_last or (ck.save_freq > 0 and self.global_step % ck.save_freq == 0)):
            return
        self.group.save_checkpoint(self.global_step, {"loader": self.loader.state_dict(),
                                                      "global_step": self.global_step, "section": self.section})

    def _resume(self) -> None:
        t = self.cfg.trainer
        if t.resume_mode == "disable":
            return
        extras = self.group.load_checkpoint(t.resume_path if t.resume_mode == "path" else None)
        extra = extras[0]
        if extra is None:
            return
        self.global_step = int(extra["global_step"])
        self.loader.load_state_dict(extra["loader"])
        logger.info("%s: resumed at step %d", self.section, self.global_step)
        if self.tracker is not None:
            self.tracker.truncate_after(self.global_step)  # the killed run's later rows are logged again

    # ---------------------------------------------------------------------------------------------- export
    def export_dir(self) -> Path:
        return Path(self.sec.export_dir or Path(self.cfg.trainer.run_dir) / "hf")

    def export(self) -> Path:
        """Write the trained model as an HF directory (`<section>.export_dir`, default `<run_dir>/hf`)."""
        out = self.export_dir()
        self.group.export_hf(str(out))
        logger.info("%s: exported the model to %s", self.section, out)
        return out

    def close(self) -> None:
        """Wait for the last save, then release the workers (every step runs, see `run_cleanups`)."""
        from hybridflow.trainer.run import run_cleanups

        run_cleanups([self.group.close_checkpoints, self.group.worker_group.shutdown, self.pool.release])


def run_supervised(trainer_cls: type[SupervisedTrainer], cfg: Config,
                   tracker: Tracker | None = None) -> tuple[Path, list[dict[str, float]]]:
    """Build `trainer_cls(cfg)`, fit, export; returns (HF directory, per-step metrics). The tracker is built from
    `trainer.logger` when not given (and closed with the run's status, see `hybridflow.trainer.run`)."""
    from hybridflow.trainer.run import cleaned_up, tracked_run

    with tracked_run(cfg, tracker) as tracker:
        trainer = trainer_cls(cfg, tracker=tracker)
        with cleaned_up(trainer.close):
            with tracker.progress(trainer.total_steps, trainer.global_step):
                history = trainer.fit()
            return trainer.export(), history
