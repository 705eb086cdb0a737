"""`@register` and the dispatch modes: how a driver call is split across ranks and how outputs are gathered.

Every mode is a `DispatchMode` (a dispatch function and a collect function) in the `DISPATCH_MODES` registry,
so built-in and user modes are looked up the same way. Data-parallel modes read each rank's `DispatchInfo`
(dp rank, dp size, is_collect) so tensor-parallel peers receive the same chunk and only one of them is gathered.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, TypeVar, overload

from hybridflow.controller.futures import GroupFuture, RemoteSlice
from hybridflow.controller.worker import DispatchInfo
from hybridflow.protocol import DataProto
from hybridflow.utils.registry import Registry

F = TypeVar("F", bound=Callable[..., Any])
REGISTER_ATTR = "_hf_register"


class Dispatch(str, Enum):
    ONE_TO_ALL = "one_to_all"  # same args to every rank; list of every rank's output
    ALL_TO_ALL = "all_to_all"  # every arg is a list with one entry per rank; list of outputs
    DP_COMPUTE_PROTO = "dp_compute_proto"  # DataProto args padded+chunked by dp rank; outputs concatenated, unpadded
    DP_COMPUTE_METRIC = "dp_compute_metric"  # chunked like DP_COMPUTE_PROTO; list of the collected ranks' outputs
    RANK_ZERO = "rank_zero"  # args to rank 0 only; rank 0's output


class Execute(str, Enum):
    ALL = "all"
    RANK_ZERO = "rank_zero"


@dataclass(frozen=True)
class RegisterSpec:
    dispatch_mode: str
    execute_mode: Execute
    blocking: bool
    timeout_s: float | None
    concurrency_group: str | None = None  # Ray: run in this named thread group of the actor (see Worker)


@overload
def register(dispatch_mode: F) -> F: ...


@overload
def register(dispatch_mode: Dispatch | str = ..., execute_mode: Execute | str = ..., blocking: bool = ...,
             timeout_s: float | None = ..., concurrency_group: str | None = ...) -> Callable[[F], F]: ...


def register(dispatch_mode: Dispatch | str | Callable[..., Any] = Dispatch.DP_COMPUTE_PROTO,
             execute_mode: Execute | str = Execute.ALL, blocking: bool = True,
             timeout_s: float | None = None, concurrency_group: str | None = None) -> Callable[..., Any]:
    """Mark a worker method as callable from the driver through a `WorkerGroup`.

    `blocking=False` makes the group method return a `GroupFuture`; `timeout_s` bounds each call (None = the
    group's `default_timeout_s`). `@register` without arguments means DP_COMPUTE_PROTO. `concurrency_group`: on
    Ray, run the call in that thread group of the actor (declared by `Worker.concurrency_groups`), beside the
    calls of the default group instead of queued behind them; the local backend runs every call at once anyway.
    """
    if callable(dispatch_mode) and not isinstance(dispatch_mode, str):
        return register()(dispatch_mode)
    mode = dispatch_mode.value if isinstance(dispatch_mode, Dispatch) else str(dispatch_mode)
    spec = RegisterSpec(mode, Execute(execute_mode), blocking, timeout_s, concurrency_group)

    def deco(fn: F) -> F:
        setattr(fn, REGISTER_ATTR, spec)
        return fn

    return deco


def registered_methods(cls: type) -> dict[str, RegisterSpec]:
    """Name → spec of every `@register`-ed method of `cls` (inherited ones included)."""
    found: dict[str, RegisterSpec] = {}
    for name in dir(cls):
        attr = inspect.getattr_static(cls, name, None)
        attr = getattr(attr, "__func__", attr)  # staticmethod / classmethod
        spec = getattr(attr, REGISTER_ATTR, None)
        if isinstance(spec, RegisterSpec):
            found[name] = spec
    return found


# ------------------------------------------------------------------------------------------ dispatch context
@dataclass(frozen=True)
class DpLayout:
    """The data-parallel layout of one group (or one role of a colocated group)."""

    dp_rank: list[int]  # per rank
    dp_size: int
    collect_ranks: list[int]  # ranks whose outputs are gathered, ordered by dp rank

    @staticmethod
    def from_infos(infos: Sequence[DispatchInfo], where: str) -> DpLayout:
        sizes = {i.dp_size for i in infos}
        if len(sizes) != 1:
            raise ValueError(f"{where}: ranks declare different dp_size values {sorted(sizes)}; every rank must "
                             f"call set_dispatch_info with the same dp_size")
        dp_size = sizes.pop()
        collect = sorted((i.dp_rank, r) for r, i in enumerate(infos) if i.is_collect)
        if [d for d, _ in collect] != list(range(dp_size)):
            raise ValueError(f"{where}: collected dp ranks are {[d for d, _ in collect]}, expected each of "
                             f"0..{dp_size - 1} exactly once; mark one rank per dp rank with is_collect=True")
        return DpLayout([i.dp_rank for i in infos], dp_size, [r for _, r in collect])


class DispatchContext:
    """What a dispatch function may know about the group: world size, backend kind, and (queried lazily,
    cached) the data-parallel layout."""

    def __init__(self, world_size: int, backend_kind: str, query: Callable[[], list[DispatchInfo]],
                 where: str) -> None:
        self.world_size, self.backend_kind = world_size, backend_kind
        self._query, self._where = query, where
        self._layout: DpLayout | None = None

    @property
    def dp_layout(self) -> DpLayout:
        if self._layout is None:
            self._layout = DpLayout.from_infos(self._query(), self._where)
        return self._layout

    def refresh(self) -> None:
        self._layout = None


@dataclass
class DispatchPlan:
    """Per-rank arguments (one entry per executed rank) and the state the collect function needs."""

    args: list[tuple[Any, ...]]
    kwargs: list[dict[str, Any]]
    state: Any = None
    rows: tuple[int, int] | None = None  # (pad_size, unpadded rows) when outputs are row-aligned DataProtos


@dataclass(frozen=True)
class DispatchMode:
    name: str
    dispatch: Callable[[DispatchContext, tuple[Any, ...], dict[str, Any]], DispatchPlan]
    collect: Callable[[DispatchContext, list[Any], Any], Any]
    takes_futures: bool = False  # False: the group resolves GroupFuture args on the driver before dispatch
    rank_zero_only: bool = False
    chains_proto: bool = False  # outputs are dp-chunked DataProtos another DP call may consume by reference
    # What a blocking group call returns, for typed handles (`controller.proxy`): one result, or one per rank;
    # None = not declared (custom modes), either is accepted.
    result: Literal["gathered", "per_rank"] | None = None


DISPATCH_MODES: Registry[DispatchMode] = Registry("dispatch mode")


def register_dispatch_mode(name: str, dispatch_fn: Callable[[DispatchContext, tuple[Any, ...], dict[str, Any]],
                                                            DispatchPlan],
                           collect_fn: Callable[[DispatchContext, list[Any], Any], Any], *,
                           takes_futures: bool = False, override: bool = False,
                           result: Literal["gathered", "per_rank"] | None = None) -> None:
    """Add a user dispatch mode usable as `@register(dispatch_mode=name)`.

    `dispatch_fn(ctx, args, kwargs)` returns a `DispatchPlan` with one args tuple and kwargs dict per rank;
    `collect_fn(ctx, outputs, plan.state)` turns the per-rank outputs (rank order) into the call's result;
    `result` ("gathered" | "per_rank") lets typed handles check how a method of this mode is declared.
    """
    DISPATCH_MODES.register(name, override=override)(
        DispatchMode(name, dispatch_fn, collect_fn, takes_futures=takes_futures, result=result))


# -------------------------------------------------------------------------------------------- built-in modes
def _one_to_all(ctx: DispatchContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DispatchPlan:
    return DispatchPlan([args] * ctx.world_size, [kwargs] * ctx.world_size)


def _all_to_all(ctx: DispatchContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DispatchPlan:
    n = ctx.world_size
    for where, value in [*((f"positional arg {i}", a) for i, a in enumerate(args)),
                         *((f"keyword arg {k!r}", v) for k, v in kwargs.items())]:
        if not isinstance(value, (list, tuple)) or len(value) != n:
            got = f"{type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) \
                else type(value).__name__
            raise ValueError(f"ALL_TO_ALL: {where} must be a list with one entry per rank ({n}), got {got}")
    return DispatchPlan([tuple(a[r] for a in args) for r in range(n)],
                        [{k: v[r] for k, v in kwargs.items()} for r in range(n)])


def _as_list(ctx: DispatchContext, outputs: list[Any], state: Any) -> list[Any]:
    return list(outputs)


def _rank_zero(ctx: DispatchContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DispatchPlan:
    return DispatchPlan([args], [kwargs])


def _first(ctx: DispatchContext, outputs: list[Any], state: Any) -> Any:
    return outputs[0]


def _split_rows(ctx: DispatchContext, value: Any, dp: int) -> tuple[list[Any], int, int] | None:
    """(one chunk per dp rank, pad_size, unpadded rows) for a DataProto or a chained future; None = broadcast."""
    if isinstance(value, GroupFuture):
        layout = value.layout
        if layout is not None and layout.backend_kind == ctx.backend_kind:
            if layout.dp_size == dp:
                return list(layout.refs_by_dp_rank), layout.pad_size, layout.n_rows
            if ctx.backend_kind == "ray":
                slices = [RemoteSlice(layout.refs_by_dp_rank, layout.pad_size, d, dp) for d in range(dp)]
                return slices, -layout.n_rows % dp, layout.n_rows
        value = value.get()
    if isinstance(value, DataProto):
        if dp == 1:  # no padding, no slicing: hand the batch over as is
            return [value], 0, len(value)
        padded, pad_size = value.pad_to_divisor(dp)
        return padded.chunk(dp), pad_size, len(value)
    return None


def _dp_dispatch(ctx: DispatchContext, args: tuple[Any, ...], kwargs: dict[str, Any]) -> DispatchPlan:
    layout = ctx.dp_layout
    dp = layout.dp_size
    rows: tuple[int, int] | None = None

    def convert(key: int | str, value: Any) -> tuple[bool, Any]:
        nonlocal rows
        split = _split_rows(ctx, value, dp)
        if split is None:
            return False, value
        chunks, pad_size, n_rows = split
        if rows is not None and n_rows != rows[1]:
            raise ValueError(f"DP dispatch: argument {key!r} has {n_rows} rows but an earlier DataProto argument "
                             f"has {rows[1]}; every DataProto argument must have the same length")
        rows = (pad_size, n_rows)
        return True, chunks

    split_args = [convert(i, a) for i, a in enumerate(args)]
    split_kwargs = {k: convert(k, v) for k, v in kwargs.items()}
    per_args, per_kwargs = [], []
    for r in range(ctx.world_size):
        d = layout.dp_rank[r]
        per_args.append(tuple(v[d] if is_split else v for is_split, v in split_args))
        per_kwargs.append({k: v[d] if is_split else v for k, (is_split, v) in split_kwargs.items()})
    return DispatchPlan(per_args, per_kwargs, state=rows, rows=rows)


def _collected(ctx: DispatchContext, outputs: list[Any]) -> list[Any]:
    return [outputs[r] for r in ctx.dp_layout.collect_ranks]


def _dp_collect_proto(ctx: DispatchContext, outputs: list[Any], rows: tuple[int, int] | None) -> Any:
    parts = _collected(ctx, outputs)
    if all(p is None for p in parts):
        return None
    if not all(isinstance(p, DataProto) for p in parts):
        kinds = sorted({type(p).__name__ for p in parts})
        raise TypeError(f"DP_COMPUTE_PROTO: workers returned {kinds}; return a DataProto (or None), or register "
                        f"the method with Dispatch.DP_COMPUTE_METRIC to get the raw per-rank list")
    merged = parts[0] if len(parts) == 1 else DataProto.concat(parts)  # one part: no copy
    if rows is None or rows[0] == 0:
        return merged
    pad_size, n_rows = rows
    if len(merged) != n_rows + pad_size:
        raise ValueError(f"DP_COMPUTE_PROTO: input was padded by {pad_size} rows to {n_rows + pad_size} but the "
                         f"outputs have {len(merged)} rows; padding can only be removed from row-aligned outputs "
                         f"(send a batch divisible by the dp size {ctx.dp_layout.dp_size})")
    return merged.unpad(pad_size)


def _dp_collect_metric(ctx: DispatchContext, outputs: list[Any], state: Any) -> list[Any]:
    return _collected(ctx, outputs)


DISPATCH_MODES.register(Dispatch.ONE_TO_ALL.value)(
    DispatchMode(Dispatch.ONE_TO_ALL.value, _one_to_all, _as_list, result="per_rank"))
DISPATCH_MODES.register(Dispatch.ALL_TO_ALL.value)(
    DispatchMode(Dispatch.ALL_TO_ALL.value, _all_to_all, _as_list, result="per_rank"))
DISPATCH_MODES.register(Dispatch.RANK_ZERO.value)(
    DispatchMode(Dispatch.RANK_ZERO.value, _rank_zero, _first, rank_zero_only=True, result="gathered"))
DISPATCH_MODES.register(Dispatch.DP_COMPUTE_PROTO.value)(
    DispatchMode(Dispatch.DP_COMPUTE_PROTO.value, _dp_dispatch, _dp_collect_proto, takes_futures=True,
                 chains_proto=True, result="gathered"))
DISPATCH_MODES.register(Dispatch.DP_COMPUTE_METRIC.value)(
    DispatchMode(Dispatch.DP_COMPUTE_METRIC.value, _dp_dispatch, _dp_collect_metric, takes_futures=True,
                 result="per_rank"))
