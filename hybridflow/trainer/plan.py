"""How many steps a run trains and what that is in epochs of its data, in the words the run's first line uses.

The rule is verl's: `trainer.total_training_steps` (or a method's own step count) set → the loader cycles through
epochs until that many steps; unset → `total_epochs × batches per epoch`.
"""

from __future__ import annotations


def steps_for(total_training_steps: int | None, total_epochs: int, batches_per_epoch: int) -> int:
    """The run's optimizer steps by the rule above."""
    return int(total_training_steps) if total_training_steps else int(total_epochs) * int(batches_per_epoch)


def step_plan_text(total_steps: int, start_step: int, batches_per_epoch: int, rows: int, batch_size: int) -> str:
    """E.g. "30 steps = 1.07 epochs of 900 rows at 32 a step (28 batches an epoch)"."""
    epochs = total_steps / batches_per_epoch if batches_per_epoch else 0.0
    text = (f"{total_steps} steps = {epochs:.2f} epochs of {rows} rows at {batch_size} a step "
            f"({batches_per_epoch} batches an epoch)")
    if start_step:
        text += f"; resuming after step {start_step}, {max(0, total_steps - start_step)} to go"
    return text
