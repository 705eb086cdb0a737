"""Supervised fine-tuning: `SFTAlgorithm` (run as `SFTTrainer(cfg).fit()`) and the quickstart's warm start
`run_sft(cfg, steps=...)` with its target gate (`sft.target_val_loss`, `stop_at_target`, `extra_schedules`).

The loss is the token-mean negative log-likelihood of the response tokens only (prompt tokens are never
trained on), computed by the same TrainEngine as PPO (packing, FSDP2, local or Ray) from the engine layout of
`supervised_batch`. Validation reports `val/loss` and `val/token_accuracy` (greedy token = target token).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from hybridflow.config import Config
from hybridflow.config.schema import SFTConfig
from hybridflow.data.build import build_sft_datasets
from hybridflow.engine import EngineSpec, HeadRequest
from hybridflow.models.loader import load_image_processor
from hybridflow.protocol import DataProto
from hybridflow.trainer.supervised import SupervisedAlgorithm, SupervisedTrainer
from hybridflow.workers.engine_specs import sft_head, sft_spec
from hybridflow.workers.supervised_batch import collate_sft_rows

if TYPE_CHECKING:
    from hybridflow.tracking import Tracker

logger = logging.getLogger(__name__)


class SFTAlgorithm(SupervisedAlgorithm):
    section, loss = "sft", "sft"
    sec: SFTConfig

    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        return build_sft_datasets(self.cfg.data, self.tokenizer, label_noise=self.cfg.sft.label_noise,
                                  image_processor=load_image_processor(self.cfg.model))

    def collate_fn(self) -> Callable[[list[Any]], DataProto]:
        return functools.partial(collate_sft_rows, pad_token_id=self.pad_id)

    def engine_spec(self) -> EngineSpec:
        return sft_spec(self.cfg, self.total_steps, self.model_path())

    def train_head(self) -> HeadRequest:
        return sft_head(self.cfg)

    def run(self, step: int) -> dict[str, float]:
        """Token-mean NLL and greedy token accuracy of the validation responses."""
        loader = self.make_loader(self.val_ds, shuffle=False, drop_last=False)
        totals = torch.zeros(3, dtype=torch.float64)
        for batch in loader:
            out = self.group.eval_lm(batch).batch
            totals += torch.stack([out["sum_logp"].sum(), out["num_tokens"].sum(), out["num_correct"].sum()]).double()
        sum_logp, tokens, correct = totals.tolist()
        tokens = max(tokens, 1.0)
        return {"val/loss": -sum_logp / tokens, "val/token_accuracy": correct / tokens}

    def reached_target(self, metrics: dict[str, float]) -> bool:
        target = self.sec.target_val_loss
        return self.sec.stop_at_target and target is not None and metrics.get("val/loss", float("inf")) <= target

    final_schedule = True  # run_sft: False while an extra schedule (sft.extra_schedules) may still follow

    def missed_target(self, history: list[dict[str, float]], step: int) -> None:
        target = self.sec.target_val_loss
        if target is None or self.val_ds is None or not self.final_schedule:
            return
        loss = next((m["val/loss"] for m in reversed(history) if "val/loss" in m), float("nan"))
        if loss <= target:
            return
        message = (f"SFT ended at sft.total_steps={self.total_steps} with val/loss {loss:.4f} above "
                   f"sft.target_val_loss={target}: the model may be under-trained; raise sft.total_steps (or "
                   "sft.optim.lr), or raise the target")
        if self.tracker is None:
            logger.warning(message)
        else:
            self.tracker.event("sft_target_missed", message, step=step, level="warning", val_loss=loss,
                               target=target)


class SFTTrainer(SupervisedTrainer):
    algorithm_cls = SFTAlgorithm
    algorithm: SFTAlgorithm


def sft_config(cfg: Config, *, steps: int | None = None, out_dir: str | Path | None = None,
               **sft_overrides: Any) -> Config:
    """`cfg` with the `sft` section changed (steps → total_steps, out_dir → export_dir, other fields by name)."""
    fields = dict(sft_overrides)
    if steps is not None:
        fields["total_steps"] = steps
    if out_dir is not None:
        fields["export_dir"] = str(out_dir)
    return dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, **fields))


def run_sft(cfg: Config, *, steps: int | None = None, out_dir: str | Path | None = None,
            tracker: Tracker | None = None,
            checkpoints: bool = False, **sft_overrides: Any) -> Path:
    """Train the actor's model (`model.path` or `model.preset`) with SFT on `data` (e.g. the built-in task's
    SFT rows) and export it; returns the HF directory, ready for `model.path=<it>` in PPO.

    `steps` = optimizer steps (default `sft.total_steps` / `sft.epochs`); `out_dir` = export directory (default
    `sft.export_dir`, else `<trainer.run_dir>/hf`); `sft_overrides` set other `sft` fields (batch_size,
    optim=...). A warm start neither resumes nor writes checkpoints unless `checkpoints=True` (it would share
    `trainer.default_local_dir` with the PPO run that follows).
    """
    cfg = sft_config(cfg, steps=steps, out_dir=out_dir, **sft_overrides)
    if not checkpoints:
        t = cfg.trainer
        cfg = dataclasses.replace(cfg, trainer=dataclasses.replace(
            t, resume_mode="disable", val_before_train=False,
            checkpoint=dataclasses.replace(t.checkpoint, save_freq=0)))
    sec, step, schedule = cfg.sft, 0, 0
    while True:
        trainer = SFTTrainer(cfg, tracker=tracker)
        trainer.global_step, trainer.total_steps = step, step + trainer.total_steps  # one step axis in the logs
        trainer.algorithm.final_schedule = schedule == sec.extra_schedules
        try:
            history = trainer.fit()
            path = trainer.export()
        finally:
            trainer.close()
        step = trainer.global_step
        loss = next((m["val/loss"] for m in reversed(history) if "val/loss" in m), None)
        final = trainer.algorithm.final_schedule
        if final or sec.target_val_loss is None or loss is None or loss <= sec.target_val_loss:
            break
        schedule += 1  # the gate was missed: one more warm-up + cosine schedule from the model as it is
        cfg = _next_schedule(cfg, path, schedule, loss, tracker, step)
    last = history[-1] if history else {}
    acc = last.get("val/token_accuracy")
    logger.info("SFT warm start: %d steps, loss %.4f, val token accuracy %s → %s", step,
                last.get("sft/loss", float("nan")), "n/a" if acc is None else f"{acc:.3f}", path)
    return path


def _next_schedule(cfg: Config, path: Path, schedule: int, loss: float, tracker: Tracker | None,
                   step: int) -> Config:
    """The config of the `schedule`-th extra schedule: from `path`, `sft.extra_schedule_steps` steps, exported
    beside the previous model."""
    sec = cfg.sft
    message = (f"SFT val/loss {loss:.4f} is above sft.target_val_loss={sec.target_val_loss} after step {step}: "
               f"running extra schedule {schedule} of {sec.extra_schedules} ({sec.extra_schedule_steps} steps, "
               "sft.extra_schedules) from the current model")
    if tracker is None:
        logger.warning(message)
    else:
        tracker.event("sft_extra_schedule", message, step=step, level="warning", val_loss=loss, schedule=schedule)
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, path=str(path)),
        sft=dataclasses.replace(sec, total_steps=sec.extra_schedule_steps, export_dir=f"{path}_{schedule + 1}"))
