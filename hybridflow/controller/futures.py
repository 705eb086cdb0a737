"""`GroupFuture`: the result of a non-blocking worker-group call, passable as an argument to the next call.

A future from a `DP_COMPUTE_PROTO` call remembers where each data-parallel chunk lives (`ProtoLayout`), so a
following data-parallel call hands each rank its chunk by reference (Ray ObjectRefs): the data moves worker to
worker and never returns to the driver. When the dp sizes differ, each rank gets a `RemoteSlice` and cuts its
chunk itself. Any other future is resolved on the driver first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridflow.protocol import DataProto

if TYPE_CHECKING:
    from hybridflow.controller.backends.base import Backend
    from hybridflow.protocol import DataProto


@dataclass(frozen=True)
class ProtoLayout:
    """Where the chunks of a DP_COMPUTE_PROTO result live: one backend reference per dp rank, still padded."""

    backend_kind: str
    refs_by_dp_rank: list[Any]
    dp_size: int
    pad_size: int
    n_rows: int  # rows after removing the padding


@dataclass(frozen=True)
class RemoteSlice:
    """Resolved inside a worker: gather a producer's chunks, drop its padding, re-pad and cut this rank's chunk."""

    refs_by_dp_rank: list[Any]
    producer_pad: int
    dp_rank: int
    dp_size: int

    def resolve(self, get: Callable[[list[Any]], list[Any]]) -> DataProto:
        whole = DataProto.concat(get(self.refs_by_dp_rank)).unpad(self.producer_pad)
        padded, _ = whole.pad_to_divisor(self.dp_size)
        return padded.chunk(self.dp_size)[self.dp_rank]


class GroupFuture:
    """Pending result of `wg.method(...)` for a method registered with `blocking=False`.

    `get()` waits (optionally with a timeout), gathers the ranks' outputs and returns what the blocking call
    would have returned. Pass the future itself into another group call to keep the data on the workers.
    """

    __slots__ = ("_backend", "group", "method", "_refs", "_ranks", "_finish", "layout", "_timeout_s", "_value",
                 "_has_value")

    def __init__(self, backend: Backend, group: str, method: str, refs: Sequence[Any], ranks: Sequence[int],
                 finish: Callable[[list[Any]], Any], layout: ProtoLayout | None, timeout_s: float | None) -> None:
        self._backend, self.group, self.method = backend, group, method
        self._refs, self._ranks, self._finish = list(refs), list(ranks), finish
        self.layout, self._timeout_s = layout, timeout_s
        self._value: Any = None
        self._has_value = False

    @property
    def backend_kind(self) -> str:
        return self._backend.kind

    def get(self, timeout_s: float | None = None) -> Any:
        """Wait for every rank and return the gathered result (cached after the first call)."""
        if not self._has_value:
            outputs = self._backend.wait(self._refs, self._ranks, self.group, self.method,
                                         timeout_s if timeout_s is not None else self._timeout_s)
            self._value, self._has_value = self._finish(outputs), True
        return self._value

    @property
    def fetched(self) -> bool:
        """True once `get()` brought the result to the driver (chaining into another call does not)."""
        return self._has_value

    def done(self) -> bool:
        """True when every rank has finished (successfully or not); never blocks."""
        return self._has_value or self._backend.ready(self._refs)

    def __repr__(self) -> str:
        state = "done" if self._has_value else "pending"
        return f"GroupFuture({self.group}.{self.method}, ranks={self._ranks}, {state})"
