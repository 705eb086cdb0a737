"""FSDP2 training engine: wrapping, mixed precision, optimizer + LR schedule, packing, chunked log-probs, offload."""

from hybridflow.engine.train_engine import TrainEngine

__all__ = ["TrainEngine", "build_train_engine"]


def build_train_engine(*args, **kwargs) -> TrainEngine:  # noqa: ANN002, ANN003 - same signature as TrainEngine
    """Factory kept for call sites that prefer a function; see `TrainEngine`."""
    return TrainEngine(*args, **kwargs)
