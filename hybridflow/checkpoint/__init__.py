"""Checkpoints: atomic + async saves, retention, fsspec remote mirror, resume, rollback, NaN guard, HF export; the
driver policy every trainer uses (`policy.CheckpointPolicy`) and the methods every trained worker registers
(`worker.CheckpointingWorker`)."""

from hybridflow.checkpoint.async_writer import CheckpointWriteError
from hybridflow.checkpoint.manager import CheckpointManager, LoadedCheckpoint
from hybridflow.checkpoint.nan_guard import NonFiniteError, NonFiniteGuard
from hybridflow.checkpoint.remote import RemoteMirror, join_url
from hybridflow.checkpoint.resume import (
    DataPosition,
    find_resume_checkpoint,
    position_from_step,
    remaining_batches,
)
from hybridflow.checkpoint.rng import capture_rng_state, restore_rng_state
from hybridflow.checkpoint.rollback import RollbackDecision, RollbackTracker, scale_lr

__all__ = [
    "CheckpointManager", "CheckpointWriteError", "DataPosition", "LoadedCheckpoint", "NonFiniteError",
    "NonFiniteGuard", "RemoteMirror", "RollbackDecision", "RollbackTracker", "capture_rng_state",
    "find_resume_checkpoint", "join_url", "position_from_step", "remaining_batches", "restore_rng_state", "scale_lr",
]
