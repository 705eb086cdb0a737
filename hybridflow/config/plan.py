"""The step plan of a run: how many optimizer steps, and how many passes over the data that is.

One rule for every command: a step count set in the config (`trainer.total_training_steps`; `sft|rm|dpo.
total_steps`) is the run's length and the loader cycles epochs until it is reached; unset, the run is
`epochs × batches per epoch`. `config validate` prints the plan and the trainer logs it as its first line.
"""

from __future__ import annotations

import math

from hybridflow.config.schema import Config

COMMANDS = ("train", "sft", "rm", "dpo")
BATCH_UNITS = {"train": "prompts", "sft": "sequences", "rm": "pairs", "dpo": "pairs"}


def _sizes(cfg: Config, command: str) -> tuple[int, int | None, int, bool, str]:
    """(batch size, steps set or None, epochs, drop_last, unit) of `command`."""
    if command not in COMMANDS:
        raise ValueError(f"command {command!r}: must be one of {', '.join(COMMANDS)}")
    if command == "train" or (command == "dpo" and cfg.dpo.online):  # online DPO is sized like `train`
        t = cfg.trainer
        return cfg.data.train_batch_size, t.total_training_steps, t.total_epochs, cfg.data.drop_last, "prompts"
    sec = getattr(cfg, command)
    return sec.batch_size, sec.total_steps, sec.epochs, True, BATCH_UNITS[command]


def step_keys(cfg: Config, command: str) -> tuple[str, str, str]:
    """The config keys of (batch size, steps, epochs) for `command`, for messages."""
    if command == "train" or (command == "dpo" and cfg.dpo.online):
        return "data.train_batch_size", "trainer.total_training_steps", "trainer.total_epochs"
    return f"{command}.batch_size", f"{command}.total_steps", f"{command}.epochs"


def planned_steps(steps_set: int | None, epochs: int, batches_per_epoch: int) -> int:
    """The rule: a step count set wins (the data cycles); else every epoch's batches."""
    return int(steps_set) if steps_set else int(epochs) * int(batches_per_epoch)


def plan_line(total: int, rows: int, batch: int, batches_per_epoch: int, unit: str = "", why: str = "") -> str:
    """E.g. "30 steps = 1.07 epochs of 900 rows at 32 prompts a step (trainer.total_training_steps=30)"."""
    epochs = total / batches_per_epoch if batches_per_epoch else 0.0
    text = f"{total} steps = {epochs:.2f} epochs of {rows} rows at {batch}{' ' + unit if unit else ''} a step"
    return f"{text} ({why})" if why else text


def step_plan(cfg: Config, rows: int, command: str = "train") -> tuple[int, float, str]:
    """(total optimizer steps, epochs as a float, one line saying so) for a training set of `rows` rows.

    E.g. "30 steps = 1.07 epochs of 900 rows at 32 prompts a step (trainer.total_training_steps=30)". Raises
    ValueError when the batch is larger than the data (no full batch, with drop_last)."""
    batch, steps_set, epochs, drop_last, unit = _sizes(cfg, command)
    batch_key, steps_key, epochs_key = step_keys(cfg, command)
    per_epoch = rows // batch if drop_last else math.ceil(rows / batch)
    if per_epoch == 0:
        raise ValueError(f"{batch_key}={batch} {unit} is larger than the training set ({rows} rows): lower "
                         f"{batch_key} or add data")
    total = planned_steps(steps_set, epochs, per_epoch)
    why = f"{steps_key}={steps_set}" if steps_set else f"{epochs_key}={epochs} x {per_epoch} batches"
    return total, total / per_epoch, plan_line(total, rows, batch, per_epoch, unit, why)
