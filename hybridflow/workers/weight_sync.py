"""Trainer → rollout weight broadcast for the non-sync modes (`trainer.mode=one_step_off|async`).

The actor's parameters (FSDP2 shards gathered to full tensors) are packed into flat buckets of at most
`trainer.weight_sync.bucket_mb`, one dtype per bucket, in `named_parameters()` order; the rollout worker copies
each bucket's slices into its own module's parameters of the same names. A copy, not a cast: the rollout's weights
are bit-identical to the trainer's (tests/trainer/test_async_modes.py, test_weight_collective_ray.py).

Transport (`trainer.weight_sync.transport`): `call` — the buckets travel as ordinary call arguments (Ray's object
store between processes, a reference in the local backend), actor rank 0 → driver → every rollout rank;
`collective` (the Ray default) — only their layout (`BucketSpec`s) goes through the call and the flat tensors are
broadcast from actor rank 0 to every rollout rank over a process group of their own (`weight_collective.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class BucketSpec:
    """A bucket's layout without its data: what a receiver needs to allocate its buffer and slice it."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    numel: int


@dataclass
class WeightBucket:
    """Consecutive parameters of one dtype flattened into `flat` (`names[i]` has `shapes[i]`)."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    flat: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    @property
    def spec(self) -> BucketSpec:
        return BucketSpec(tuple(self.names), tuple(self.shapes), self.flat.dtype, self.flat.numel())

    @classmethod
    def from_spec(cls, spec: BucketSpec, flat: torch.Tensor) -> WeightBucket:
        assert flat.dtype == spec.dtype and flat.numel() == spec.numel, (spec, flat.dtype, flat.numel())
        return cls(list(spec.names), list(spec.shapes), flat)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        offset = 0
        for name, shape in zip(self.names, self.shapes):
            numel = 1
            for d in shape:
                numel *= d
            yield name, self.flat[offset:offset + numel].view(shape)
            offset += numel


def full_parameters(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor on CPU) for every parameter; FSDP2 DTensors are gathered (a collective: every rank of
    the group must iterate)."""
    for name, p in module.named_parameters():
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        yield name, t.to("cpu")


def pack_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[WeightBucket]:
    """Flat buckets of at most `bucket_bytes` (a larger tensor gets a bucket of its own), a new bucket at each
    dtype change."""
    buckets: list[WeightBucket] = []
    names: list[str] = []
    parts: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        nonlocal names, parts, size
        if parts:
            buckets.append(WeightBucket(names, [tuple(p.shape) for p in parts],
                                        torch.cat([p.reshape(-1) for p in parts])))
        names, parts, size = [], [], 0

    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if parts and (parts[0].dtype != t.dtype or size + nbytes > bucket_bytes):
            flush()
        names.append(name)
        parts.append(t)
        size += nbytes
    flush()
    return buckets


@torch.no_grad()
def load_buckets(module: nn.Module, buckets: list[WeightBucket]) -> int:
    """Copy every bucket into `module`'s parameters of the same names; returns the bytes received. Every
    parameter of `module` must be covered exactly once, with the same shape and dtype."""
    params = dict(module.named_parameters())
    seen: set[str] = set()
    total = 0
    for bucket in buckets:
        total += bucket.nbytes
        for name, src in bucket.tensors():
            dst = params.get(name)
            if dst is None:
                raise KeyError(f"weight sync: the trainer sent parameter {name!r}, which the rollout model lacks "
                               f"(are both built from the same model.path / model.preset?)")
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise ValueError(f"weight sync: {name!r} is {tuple(src.shape)} {src.dtype} on the trainer but "
                                 f"{tuple(dst.shape)} {dst.dtype} on the rollout worker")
            dst.copy_(src)
            seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise KeyError(f"weight sync: the trainer sent no value for {missing[:5]} ({len(missing)} parameters)")
    return total
