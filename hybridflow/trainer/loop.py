"""`Trainer`: the one driver loop of every training method (PPO/GRPO, SFT, reward model; DPO later).

resume → validate before training → per step: algorithm step, NaN guard, validation every `trainer.test_freq`,
log, rollback, checkpoint every `trainer.checkpoint.save_freq` → close. What differs between methods is an
`Algorithm`: its data loader, its worker groups and its `step(batch, step)` — the numbered stage list. The
checkpoint policy is `CheckpointPolicy`'s, the run status `tracked_run`'s (`hybridflow.trainer.run`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from hybridflow.checkpoint import atomic
from hybridflow.checkpoint.policy import CheckpointPolicy
from hybridflow.config import Config, to_dict
from hybridflow.config.plan import plan_line
from hybridflow.data.contract import skipped_rows_event
from hybridflow.data.dataloader import DataPosition
from hybridflow.protocol import DataProto
from hybridflow.trainer.stop import Interrupted, StopRequest, graceful_stop, run_cleanups, signals_deferred

if TYPE_CHECKING:
    from hybridflow.checkpoint.worker import CheckpointingGroup
    from hybridflow.data.contract import SkipReport
    from hybridflow.data.dataloader import StatefulDataLoader
    from hybridflow.tracking import HealthEvent, Tracker

logger = logging.getLogger(__name__)


class Validator(Protocol):
    def run(self, step: int) -> dict[str, float]:
        """Validation metrics (`val/...`, `timing/val`) of the model as it is at `step`."""
        ...


class Algorithm(ABC):
    """What one training method gives the loop. Subclasses set the attributes in `__init__`."""

    loader: StatefulDataLoader
    total_steps: int  # optimizer steps of the run (also sizes the LR schedules)
    total_epochs: int | None = None  # stop after this many passes over the data (None: cycle until total_steps)
    validator: Validator | None = None
    guarded: tuple[str, ...] = ()  # metric namespaces the NaN guard reads (`<ns>/loss`, `<ns>/grad_norm`)
    batch_unit: str = "rows"  # what a batch counts, for the plan line (prompts, sequences, pairs)

    @abstractmethod
    def step(self, batch: DataProto, step: int) -> dict[str, float]:
        """Train on `batch` as optimizer step `step`; returns its metrics."""

    @abstractmethod
    def checkpoint_groups(self) -> dict[str, CheckpointingGroup]:
        """The groups that checkpoint: {"": group} for one root, else {sub-directory: group}."""

    @abstractmethod
    def cleanups(self) -> list[Callable[[], object]]:
        """Release workers and pools, in order (each runs even when an earlier one fails)."""

    def state_dict(self) -> dict[str, Any]:
        """Driver-side state saved in the checkpoint's `extra` (JSON)."""
        return {}

    def load_state_dict(self, extra: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore `state_dict()` from a checkpoint's `extra` when resuming."""

    def checkpoint_payload(self) -> dict[str, Any] | None:
        """Driver-side state with tensors, saved inside the checkpoint beside `extra` (safetensors + a JSON skeleton,
        never pickle); called right after `state_dict()` for the same save. None: nothing to save."""
        return None

    def load_checkpoint_payload(self, payload: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore `checkpoint_payload()` when resuming (after `load_state_dict`)."""

    def on_rollback(self, extra: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """The workers were rolled back to a checkpoint whose `extra` is given (data position moves on)."""

    def batches(self, source: Iterator[DataProto], start_step: int) -> Iterator[DataProto]:
        """What `step` receives, from the loader's batches; `start_step` is the last step already trained. The
        default passes them through; PPO's non-sync modes yield batches generated ahead (trainer/async_driver.py)."""
        return source

    def skip_reports(self) -> list[SkipReport]:
        """Rows the datasets left out at load (reported once, `data_skipped` + `data/skipped_rows`)."""
        return []

    def reached_target(self, metrics: dict[str, float]) -> bool:
        """True when a step's validated `metrics` meet the method's stop criterion (none by default)."""
        return False

    def missed_target(self, history: list[dict[str, float]], step: int) -> None:  # noqa: B027 - optional hook
        """`total_steps` ran out before `reached_target` held."""


class Trainer:
    """Runs `algorithm` for `algorithm.total_steps` steps with checkpoints, validation, logging and a NaN guard."""

    def __init__(self, cfg: Config, algorithm: Algorithm, tracker: Tracker | None = None) -> None:
        self.cfg, self.algorithm, self.tracker = cfg, algorithm, tracker
        self.loader = algorithm.loader
        self.total_steps = algorithm.total_steps
        self.validator = algorithm.validator
        self.global_step = 0
        self.steps_run = 0  # optimizer steps this process ran (0 when resumed at total_steps)
        self.epoch = 0
        self.history: list[dict[str, float]] = []
        self._once_metrics: dict[str, float] = {}  # sent with the first logged step of this process
        self.stop = StopRequest()  # replaced by `fit`'s signal-backed request while training
        self.ckpt = CheckpointPolicy(cfg, algorithm.checkpoint_groups(), algorithm.guarded, tracker,
                                     on_rollback=algorithm.on_rollback, payload=algorithm.checkpoint_payload)

    def step(self, batch: DataProto) -> dict[str, float]:
        """One optimizer step of the algorithm at `global_step` (tests and benchmarks call or wrap it)."""
        return self.algorithm.step(batch, self.global_step)

    def validate(self) -> dict[str, float]:
        return self.validator.run(step=self.global_step) if self.validator is not None else {}

    # ------------------------------------------------------------------------------------------------ fit
    def fit(self) -> list[dict[str, float]]:
        """Train up to `total_steps`; returns the per-step metrics (also sent to the tracker). The first SIGINT or
        SIGTERM stops after the step in flight with a checkpoint and raises `Interrupted` (trainer/stop.py)."""
        self._resume()
        self._report_skipped_rows()
        if self.global_step < self.total_steps:
            self._announce_plan()
        with graceful_stop() as self.stop:
            if self.cfg.trainer.val_before_train and self.validator is not None and self.global_step == 0:
                self._log(self.validate(), step=0)
            if self.tracker is not None:
                self.tracker.start_progress(self.total_steps, initial_step=self.global_step)
            try:
                self._train_loop()
            finally:
                if self.tracker is not None:
                    self.tracker.stop_progress()
        return self.history

    def _train_loop(self) -> None:
        if self.global_step >= self.total_steps:
            message = (f"resumed at step {self.global_step} of {self.total_steps} from trainer.default_local_dir: "
                       "nothing left to train (raise the step count to train on, or set "
                       "trainer.resume_mode=disable to start over)")
            if self.tracker is not None:
                self.tracker.event("nothing_to_train", message, self.global_step)
            else:
                logger.info(message)
            return
        self._stop_if_requested()
        for batch in self.algorithm.batches(self._batches(), self.global_step):
            self.global_step += 1
            self.steps_run += 1
            self.ckpt.poll()  # a failed background save surfaces here
            metrics = self.step(batch)
            metrics |= self.ckpt.check_finite(metrics, self.global_step)  # skipped-step count, stop or roll back
            if self._end_step(metrics, is_last=self.global_step >= self.total_steps):
                return
            self._stop_if_requested()
        self._data_ran_out()

    def _end_step(self, metrics: dict[str, float], is_last: bool) -> bool:
        """Validate (every `trainer.test_freq` steps and at the last), log, roll back, save; True when the run ends
        here (last step or stop criterion met)."""
        test_freq = self.cfg.trainer.test_freq
        val: dict[str, float] = {}
        if self.validator is not None and (is_last or (test_freq > 0 and self.global_step % test_freq == 0)):
            val = self.validate()
        done = bool(val) and self.algorithm.reached_target(metrics | val)
        warnings = self._log(metrics | val, step=self.global_step)
        self.ckpt.after_validation(val, warnings, self.global_step)  # may roll back to the best checkpoint
        self.ckpt.maybe_save(self.global_step, is_last or done, self._extra)
        if self.tracker is not None:
            self.tracker.advance(self.global_step)
        if done:
            logger.info("stop criterion met at step %d of at most %d", self.global_step, self.total_steps)
        elif is_last:
            self.algorithm.missed_target(self.history, self.global_step)
        return done or is_last

    def _data_ran_out(self) -> None:
        """The batches ended before `total_steps` (a finite batch source, or dynamic sampling drawing extra batches
        within `trainer.total_epochs`): say so, then validate and save the last step as a planned end would."""
        message = (f"the training data ran out at step {self.global_step} of {self.total_steps} "
                   f"({self.epoch} epoch(s) of {len(self.loader)} batches): set trainer.total_training_steps to "
                   "cycle the data for as many steps as planned")
        if self.tracker is not None:
            self.tracker.event("data_exhausted", message, self.global_step, level="warning")
        else:
            logger.warning(message)
        if self.steps_run == 0:
            return
        val = self.validate() if self.validator is not None else {}
        if val:
            self._log(val, step=self.global_step)
        self.ckpt.save_final(self.global_step, self._extra)
        self.algorithm.missed_target(self.history, self.global_step)

    def _stop_if_requested(self) -> None:
        """After a stop signal: save the step just trained (unless checkpoints are off) and raise `Interrupted`."""
        if not self.stop.requested:
            return
        assert self.stop.signum is not None, "a requested stop carries its signal"
        step = self.global_step
        if self.steps_run == 0:
            saved = "nothing trained in this run yet, nothing to save"
        else:
            path = self.ckpt.save_final(step, self._extra)
            self.ckpt.close()  # the message below may say "saved" only once the write is done
            saved = (f"checkpoint saved to {path}; rerun the same command to resume" if path is not None else
                     "no checkpoint saved (trainer.checkpoint.save_freq=0): the progress of this run is lost")
        message = f"interrupted by {self.stop.signal_name} at step {step} of {self.total_steps}; {saved}"
        if self.tracker is not None:
            self.tracker.event("interrupted", message, step, level="warning")
        raise Interrupted(message, self.stop.signum)

    def _announce_plan(self) -> None:
        """The run's plan as its first event: steps, and the epochs of data they are (config/plan.py's rule)."""
        message = plan_line(self.total_steps, self.loader.num_rows, self.loader.batch_size, len(self.loader),
                            self.algorithm.batch_unit)
        if self.global_step:
            message += f"; resuming after step {self.global_step}, {self.total_steps - self.global_step} to go"
        if self.tracker is not None:
            self.tracker.event("plan", message, self.global_step)
        else:
            logger.info(message)

    def _batches(self) -> Iterator[DataProto]:
        epochs = self.algorithm.total_epochs
        while epochs is None or self.epoch < epochs:
            yield from self.loader
            self.epoch += 1

    def _log(self, metrics: dict[str, float], step: int) -> list[HealthEvent]:
        """Log (history, tracker); returns the health monitor's warnings of this step."""
        metrics = {"training/global_step": float(step), "training/epoch": float(self.epoch), **self._once_metrics,
                   **metrics}
        self._once_metrics = {}
        self.history.append(metrics)
        if self.tracker is not None:
            return self.tracker.log(metrics, step=step)
        logger.info("step %d: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        return []

    def _report_skipped_rows(self) -> None:
        """Rows left out at load (malformed, empty prompt, over-long): one `data_skipped` event with counts,
        reasons and example rows, and `data/skipped_rows` with the first logged step."""
        reports = self.algorithm.skip_reports()
        if not reports:
            return
        message, data = skipped_rows_event(reports)
        self._once_metrics["data/skipped_rows"] = float(data["skipped_rows"])
        if data["skipped_rows"] and self.tracker is not None:
            self.tracker.event("data_skipped", message, self.global_step, level="warning", **data)

    # ------------------------------------------------------------------------------------------- checkpoints
    def _check_same_method(self) -> None:
        """A checkpoint of another method in `trainer.default_local_dir` (an SFT run's, then `train` with the same
        config) cannot be resumed: say so before the workers try to load it."""
        from pathlib import Path

        t = self.cfg.trainer
        if t.resume_mode != "auto" or "://" in t.default_local_dir:
            return
        latest = atomic.find_latest_of_run(Path(t.default_local_dir))
        if latest is None or not (latest / "extra.json").is_file():
            return
        theirs = atomic.read_json(latest / "extra.json").get("section") or "ppo"
        ours = self.algorithm.state_dict().get("section") or "ppo"
        if theirs != ours:
            raise ValueError(
                f"trainer.default_local_dir={t.default_local_dir!r} holds a {theirs} checkpoint ({latest.name}); "
                f"this {ours} run cannot resume from it. Give this run its own trainer.default_local_dir=DIR (or "
                "set trainer.resume_mode=disable to start fresh and write beside it)")

    def _resume(self) -> None:
        self._check_same_method()
        info = self.ckpt.resume()
        if info is None:
            return
        extra = info["extra"]
        self.algorithm.load_state_dict(extra)
        if info.get("payload") is not None:
            self.algorithm.load_checkpoint_payload(info["payload"])
        self.global_step = int(extra["global_step"])
        loader_state = extra["loader"]
        if "data" in extra:  # an epoch-boundary save resumes at (epoch + 1, 0), see DataPosition
            pos = DataPosition.from_dict(extra["data"], len(self.loader))
            loader_state = {**loader_state, "epoch": pos.epoch, "batch_in_epoch": pos.batch}
        self.loader.load_state_dict(loader_state)
        self.epoch = self.loader.epoch
        logger.info("resumed from %s at step %d (epoch %d, batch %d of %d)", info["path"], self.global_step,
                    self.epoch, self.loader.batch_in_epoch, len(self.loader))
        if self.tracker is not None:
            self.tracker.truncate_after(self.global_step)  # the killed run's later rows are logged again

    def _extra(self) -> dict[str, Any]:
        return {"config": to_dict(self.cfg), "global_step": int(self.global_step),
                "data": DataPosition(self.loader.epoch, self.loader.batch_in_epoch).to_dict(),
                "loader": self.loader.state_dict(), **self.algorithm.state_dict()}

    def close(self) -> None:
        """Wait for the last checkpoint save (raising its error), then release the workers; each step runs even
        when an earlier one fails (a dead worker group cannot close its checkpoints but must still be released)."""
        with signals_deferred("closing the run (the last checkpoint write, the workers)"):
            run_cleanups([self.ckpt.close, *self.algorithm.cleanups()])
