"""Faster torch.Tensor transport through Ray's object store (registered in the driver and every worker actor).

Default pickling ships a tensor's whole storage (a chunk view of a 16 MiB batch sends all 16 MiB) through a byte
copy; here a CPU tensor travels as a flat uint8 numpy view, which Ray moves out-of-band, and is copied once on
arrival so the receiver owns a writable tensor. Other tensors (CUDA, sparse, ...) keep torch's own pickling.
"""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import torch

_registered = False


def _serialize(t: torch.Tensor) -> tuple[Any, ...]:
    if t.device.type != "cpu" or t.layout != torch.strided or t.is_quantized or t.is_complex():
        return ("pickle", pickle.dumps(t))
    flat = t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy() if flat.numel() else np.empty(0, dtype=np.uint8)
    return ("flat", t.dtype, tuple(t.shape), raw)


def _deserialize(state: tuple[Any, ...]) -> torch.Tensor:
    if state[0] == "pickle":
        return pickle.loads(state[1])
    _, dtype, shape, raw = state
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.array(raw, copy=True)).view(dtype).reshape(shape)


def register_tensor_serializer() -> None:
    """Idempotent; call in every process that sends or receives tensors through Ray."""
    global _registered
    if not _registered:
        import ray

        ray.util.register_serializer(torch.Tensor, serializer=_serialize, deserializer=_deserialize)
        _registered = True
