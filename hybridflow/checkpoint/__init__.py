"""Checkpoints: atomic + async saves, retention, fsspec mirror, resume and rollback; the driver policy every
trainer uses (`policy.CheckpointPolicy`) and the methods every trained worker registers (`worker`)."""

from hybridflow.checkpoint.async_writer import CheckpointWriteError
from hybridflow.checkpoint.manager import CheckpointManager, LoadedCheckpoint, find_resume_checkpoint
from hybridflow.checkpoint.recovery import RollbackDecision, RollbackTracker
from hybridflow.checkpoint.remote import RemoteMirror, join_url

__all__ = ["CheckpointManager", "CheckpointWriteError", "LoadedCheckpoint", "RemoteMirror", "RollbackDecision",
           "RollbackTracker", "find_resume_checkpoint", "join_url"]
