"""`SupervisedAlgorithm`: one `SupervisedWorker` group trained on a fixed objective (SFT, reward model, DPO),
run by the one loop (`hybridflow.trainer.loop.Trainer`) as `SupervisedTrainer`.

A subclass says which datasets, collate function, engine spec/head/loss and validation reduction it uses; a step
is one `train_batch` call. The engine spec is derived from the section (`sft`/`rm`, see `workers/engine_specs.py`)
without touching the user's config. At the end the model is exported as an HF directory (`<section>.export_dir`,
default `<run_dir>/hf`).
"""

from __future__ import annotations

import functools
import logging
import time
from abc import abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from torch.utils.data import Dataset

from hybridflow.config import Config
from hybridflow.config.plan import BATCH_UNITS, planned_steps
from hybridflow.config.resolved import process_on_nodes
from hybridflow.config.schema import DPOConfig, RMConfig, SFTConfig
from hybridflow.controller import ResourcePool, WorkerGroup, build_backend
from hybridflow.data.dataloader import StatefulDataLoader
from hybridflow.data.templates import save_tokenizer
from hybridflow.models.loader import load_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.trainer.loop import Algorithm, Trainer
from hybridflow.trainer.metrics import reduce_metrics
from hybridflow.trainer.run import cleaned_up, tracked_run
from hybridflow.workers.supervised import SupervisedGroup, SupervisedWorker

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hybridflow.checkpoint.worker import CheckpointingGroup
    from hybridflow.controller import ResourcePool
    from hybridflow.data.contract import SkipReport
    from hybridflow.data.dataloader import StatefulDataLoader
    from hybridflow.engine import EngineSpec, HeadRequest
    from hybridflow.tracking import Tracker
    from hybridflow.workers.supervised import SupervisedGroup

logger = logging.getLogger(__name__)


class SupervisedAlgorithm(Algorithm):
    section: ClassVar[str] = ""  # "sft" | "rm" | "dpo": the config section with epochs, batch_size, optim, export_dir, ...
    loss: ClassVar[str] = ""  # SUPERVISED_LOSSES name

    def __init__(self, cfg: Config, *, tokenizer: PreTrainedTokenizerBase | None = None,
                 tracker: Tracker | None = None) -> None:
        self.cfg, self.tracker = cfg, tracker
        self.sec: SFTConfig | RMConfig | DPOConfig = getattr(cfg, self.section)
        self.guarded = (self.section,)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
        self.pad_id = int(self.tokenizer.pad_token_id or 0)
        self.train_ds, self.val_ds = self.build_datasets()
        self.world_size = self._world_size()
        self._check_batch_size()
        self.loader = self.make_loader(self.train_ds, shuffle=cfg.data.shuffle, drop_last=True)
        if len(self.loader) == 0:
            raise ValueError(f"{self.section}.batch_size={self.sec.batch_size} is larger than the training set "
                             f"({len(self.train_ds)} rows): lower {self.section}.batch_size or add data")
        self.total_steps = planned_steps(self.sec.total_steps, self.sec.epochs, len(self.loader))  # config/plan.py
        self.batch_unit = BATCH_UNITS[self.section]
        self.group = self._build_group()
        self.validator = self if self.val_ds is not None else None

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

    @abstractmethod
    def run(self, step: int) -> dict[str, float]:
        """Validation metrics (the algorithm is its own `Validator`)."""

    def model_path(self) -> str | None:
        """Where the model starts from (None = `model.path`, else `model.preset`)."""
        return None

    def loss_kwargs(self) -> dict[str, Any]:
        return {}

    def ref_spec(self) -> EngineSpec | None:
        """A frozen reference engine the worker builds beside the trained one (DPO); None = none."""
        return None

    def generates(self) -> bool:
        """Whether the worker builds a rollout engine on the trained model (validation by generation)."""
        return False

    # ----------------------------------------------------------------------------------------------- build
    def _world_size(self) -> int:
        return sum(process_on_nodes(self.cfg))

    def _check_batch_size(self) -> None:
        b, w = self.sec.batch_size, self.world_size
        if b % w:
            raise ValueError(f"{self.section}.batch_size={b} must be divisible by the {w} data-parallel ranks "
                             f"(trainer.nnodes × trainer.n_gpus_per_node); use e.g. {max(w, b // w * w)}")

    def make_loader(self, ds: Dataset, shuffle: bool, drop_last: bool) -> StatefulDataLoader:
        d = self.cfg.data
        return StatefulDataLoader(ds, self.sec.batch_size, shuffle=shuffle, drop_last=drop_last, seed=d.seed,
                                  num_workers=d.num_workers, prefetch_factor=d.prefetch_factor,
                                  persistent_workers=d.persistent_workers, collate_fn=self.collate_fn())

    def _build_group(self) -> SupervisedGroup:
        worker = functools.partial(SupervisedWorker, self.cfg, self.engine_spec(), self.train_head(), self.loss,
                                   self.loss_kwargs(), self.ref_spec(), self.generates())
        self.pool: ResourcePool = ResourcePool.from_config(self.cfg)
        backend = build_backend(self.cfg.trainer.backend, self.pool.world_size, self.cfg.trainer.ray_address)
        group = SupervisedGroup(WorkerGroup(self.pool, worker, backend=backend, name=f"{self.section}"))
        group.init_model()
        return group

    # ------------------------------------------------------------------------------------ loop interface
    def step(self, batch: DataProto, step: int) -> dict[str, float]:
        start = time.perf_counter()
        metrics = reduce_metrics(self.group.train_batch(batch), self.section)
        metrics["timing/step"] = time.perf_counter() - start
        return metrics

    def checkpoint_groups(self) -> dict[str, CheckpointingGroup]:
        return {"": self.group}

    def skip_reports(self) -> list[SkipReport]:
        """The datasets' rows left out at load (preference pairs keep a `SkipReport` in `skips`)."""
        return [ds.skips for ds in (self.train_ds, self.val_ds) if getattr(ds, "skips", None) is not None]

    def state_dict(self) -> dict[str, Any]:
        return {"section": self.section}

    def cleanups(self) -> list[Callable[[], object]]:
        return [self.group.worker_group.shutdown, self.pool.release]

    # ---------------------------------------------------------------------------------------------- export
    def export_dir(self) -> Path:
        return Path(self.sec.export_dir or Path(self.cfg.trainer.run_dir) / "hf")

    def export(self) -> Path:
        """Write the trained model as an HF directory (`<section>.export_dir`, default `<run_dir>/hf`); its
        tokenizer carries the chat template the prompts were built with (`data.chat_template`)."""

        out = self.export_dir()
        self.group.export_hf(str(out))
        save_tokenizer(self.tokenizer, out, self.cfg.data.chat_template)
        logger.info("%s: exported the model to %s", self.section, out)
        return out


class SupervisedTrainer(Trainer):
    """A supervised run: `algorithm_cls` in the one loop, then `export()`."""

    algorithm_cls: ClassVar[type[SupervisedAlgorithm]]
    algorithm: SupervisedAlgorithm

    def __init__(self, cfg: Config, *, tokenizer: PreTrainedTokenizerBase | None = None,
                 tracker: Tracker | None = None) -> None:
        super().__init__(cfg, self.algorithm_cls(cfg, tokenizer=tokenizer, tracker=tracker), tracker)

    @property
    def group(self) -> SupervisedGroup:
        return self.algorithm.group

    def export(self) -> Path:
        """The algorithm's export, except after a run that trained nothing (resumed at `total_steps`): an
        existing export is then left as it is (it is the model of that step, and what RL may be running from)."""
        out = self.algorithm.export_dir()
        if self.steps_run == 0 and (out / "config.json").is_file():
            logger.info("%s: nothing trained in this run; the model exported at step %d in %s is left as it is",
                        self.algorithm.section, self.global_step, out)
            return out
        return self.algorithm.export()


def run_supervised(trainer_cls: type[SupervisedTrainer], cfg: Config,
                   tracker: Tracker | None = None) -> tuple[Path, list[dict[str, float]]]:
    """Build `trainer_cls(cfg)`, fit, export; returns (HF directory, per-step metrics). The tracker is built from
    `trainer.logger` when not given (and closed with the run's status, see `hybridflow.trainer.run`)."""

    with tracked_run(cfg, tracker) as tracker:
        trainer = trainer_cls(cfg, tracker=tracker)
        with cleaned_up(trainer.close):
            history = trainer.fit()
            return trainer.export(), history
