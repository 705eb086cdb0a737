"""Backends that run workers: `local` (in-process, world size 1) and `ray` (one actor per rank).

`build_backend` is the one place a backend is chosen (`trainer.backend: auto|local|ray`).
"""

from __future__ import annotations

from hybridflow.controller.backends.base import Backend
from hybridflow.controller.backends.local import LocalBackend

BACKEND_NAMES = ("auto", "local", "ray")


def build_backend(name: str = "auto", world_size: int = 1, ray_address: str | None = None) -> Backend:
    """`auto` picks `local` when one process is enough (world_size == 1) and `ray` otherwise; `ray_address`: the
    running Ray cluster to join (`trainer.ray_address`)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"trainer.backend={name!r} is not a backend; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        name = "local" if world_size == 1 else "ray"
    if name == "local":
        return LocalBackend()
    try:
        from hybridflow.controller.backends.ray import RayBackend
    except ImportError as err:
        raise ImportError(f"trainer.backend=ray (world size {world_size}) needs Ray: pip install 'hybridflow[ray]' "
                          f"({err})") from err
    return RayBackend(ray_address)


__all__ = ["Backend", "LocalBackend", "build_backend", "BACKEND_NAMES"]
