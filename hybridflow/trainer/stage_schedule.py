"""Where a step's stages run: in the order the algorithm lists them, or its host scoring beside the worker calls.

Decision: the algorithm lists its stages in data order (`PPOAlgorithm.stages`) and only this module overlaps them. A
driver stage marked `overlaps` (the reward, when it needs no worker and decides nothing) is held back and runs on the
host while the next worker calls compute on the device; which calls qualify follows from the stage contracts
(`protocol.keys`): calls that do not read what the held stages write run beside them, and a call that reads it (the
actor update reads the advantages) takes it as late columns where it can (`WorkerCall.late`). In-process workers
(local backend) call the held work back on this thread once their device work is queued (a second thread would hold
the GIL while the call launches kernels); out-of-process calls run on a thread while this one scores. The held work
reaches the call as an argument (`beside`), never through shared state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.protocol import DataProto, keys
from hybridflow.trainer.timing import StageTimer

Metrics = dict[str, float]
Beside = Callable[[], DataProto]  # host work a worker call runs once its device work is queued; returns the batch


@dataclass(frozen=True)
class Stage:
    """Driver work on the batch (generate, score, balance, advantages): `run(batch, metrics)` → the batch."""

    name: str  # timed as `timing/<name>`
    run: Callable[[DataProto, Metrics], DataProto]
    contract: keys.Stage | None = None  # the keys it reads and writes (None: it reads no stage's output)
    overlaps: bool = False  # may be held and run beside later worker calls
    timed: bool = True  # False: it times its own parts


@dataclass(frozen=True)
class WorkerCall:
    """A worker-group call: `run(batch, metrics, beside)` → its new columns (None for an update). Given `beside`,
    the call runs it once its device work is queued; `late`: its loss may read `beside()`'s columns."""

    name: str
    run: Callable[[DataProto, Metrics, Beside | None], DataProto | None]
    contract: keys.Stage
    late: bool = False


AnyStage = Stage | WorkerCall


@dataclass(frozen=True)
class Overlap:
    """The plan of one step: `held` run beside `calls` (the first call takes them as late columns when `late`)."""

    held: tuple[Stage, ...]
    calls: tuple[WorkerCall, ...]
    late: bool


def plan_overlap(stages: Sequence[AnyStage], in_process: bool) -> Overlap | None:
    """What overlaps in `stages` (None: they run in order). The first `overlaps` stage is held, with the driver stages
    after it that read its output; the next worker calls that read none of it run beside them, or the first call
    alone takes them as late columns when it reads them (only in process: the columns arrive by callback)."""
    start = next((i for i, s in enumerate(stages) if isinstance(s, Stage) and s.overlaps), None)
    if start is None:
        return None
    held = [stages[start]]
    for i in range(start + 1, len(stages)):
        stage = stages[i]
        if isinstance(stage, Stage):
            if _reads(stage, held):
                held.append(stage)
            continue
        if _reads(stage, held):
            return Overlap(tuple(held), (stage,), True) if stage.late and in_process else None
        return Overlap(tuple(held), tuple(_segment(stages[i:], held)), False)
    return None


def run_stages(stages: Sequence[AnyStage], batch: DataProto, timer: StageTimer, metrics: Metrics,
               in_process: bool) -> DataProto:
    """Run `stages` on `batch` (as `plan_overlap` plans) and return it with every stage's columns."""
    plan = plan_overlap(stages, in_process)
    i = 0
    while i < len(stages):
        stage = stages[i]
        if plan is not None and stage is plan.calls[0]:
            batch = _overlapped(plan, batch, timer, metrics, in_process)
            i += len(plan.calls)
        elif plan is not None and any(stage is s for s in plan.held):
            i += 1  # runs beside the calls
        elif isinstance(stage, Stage):
            batch = _run(stage, batch, timer, metrics)
            i += 1
        else:
            calls = _segment(stages[i:], [])
            batch = _union(batch, _calls(calls, batch, timer, metrics, None))
            i += len(calls)
    return batch


def _segment(stages: Sequence[AnyStage], held: Sequence[AnyStage]) -> list[WorkerCall]:
    """The worker calls at the head of `stages` that read nothing `held` or an earlier one of them writes: they all
    take the same batch, and their columns join it afterwards."""
    out: list[WorkerCall] = []
    for stage in stages:
        if not isinstance(stage, WorkerCall) or _reads(stage, [*held, *out]):
            break
        out.append(stage)
    return out


def _reads(stage: AnyStage, before: Sequence[AnyStage]) -> bool:
    if stage.contract is None:
        return False
    written = {k.name for s in before if s.contract is not None for k in s.contract.writes}
    return any(k.name in written for k in (*stage.contract.reads, *stage.contract.optional))


def _run(stage: Stage, batch: DataProto, timer: StageTimer, metrics: Metrics, sync: bool = True) -> DataProto:
    if not stage.timed:
        return stage.run(batch, metrics)
    with timer(stage.name, sync=sync):
        return stage.run(batch, metrics)


def _calls(calls: Sequence[WorkerCall], batch: DataProto, timer: StageTimer, metrics: Metrics,
           beside: Beside | None, device: int | None = None) -> list[DataProto | None]:
    """The calls in order on `batch`, the first one with `beside`; `device`: the CUDA device (on a new thread)."""
    if device is not None:
        torch.cuda.set_device(device)
    outs = []
    for call in calls:
        with timer(call.name):
            outs.append(call.run(batch, metrics, beside))
        beside = None
    return outs


def _union(batch: DataProto, outs: Sequence[DataProto | None]) -> DataProto:
    for out in outs:
        if out is not None:
            batch = batch.union(out)
    return batch


def _overlapped(plan: Overlap, batch: DataProto, timer: StageTimer, metrics: Metrics, in_process: bool) -> DataProto:
    """The held stages on `batch` while the calls run on `batch[:]` (their own dicts: the held stages write into
    `batch`); the device work in flight is the calls', so the held stages' timers do not synchronise. An error in
    either waits for both and is the one raised (the held work's, when it failed inside a call)."""
    view = batch[:]
    call_metrics: Metrics = {}

    def held() -> DataProto:
        out = batch
        for stage in plan.held:
            out = _run(stage, out, timer, metrics, sync=False)
        return out

    if in_process:
        outs, batch = _calling_back(plan, lambda beside: _calls(plan.calls, view, timer, call_metrics, beside), held)
    else:
        with ThreadPoolExecutor(1, thread_name_prefix="worker-stages") as pool:
            future = pool.submit(_calls, plan.calls, view, timer, call_metrics, None, _cuda_device())
            try:
                batch = held()
            finally:  # never leave the workers busy behind an error
                outs = future.result()
    metrics |= call_metrics
    return _union(batch, outs)


def _calling_back(plan: Overlap, calls: Callable[[Beside], Any], held: Beside) -> tuple[Any, DataProto]:
    """`calls(beside)`, whose first worker call runs `held` through `beside` on this thread; (their result, the
    held stages' batch). A call that returned without running it is refused."""
    done: dict[str, Any] = {}

    def beside() -> DataProto:
        try:
            done["batch"] = held()
        except BaseException as exc:
            done["error"] = exc
            raise
        return done["batch"]

    try:
        result = calls(beside)
    except Exception:
        if "error" in done:  # the held stage's own error, not the worker's wrapper of it
            raise done["error"] from None
        raise
    if "batch" not in done:
        names = ", ".join(s.name for s in plan.held)
        raise RuntimeError(f"the {plan.calls[0].name} call returned without running {names} beside it; set "
                           "reward.overlap=false and report this")
    return result, done["batch"]


def _cuda_device() -> int | None:
    """The driver thread's CUDA device (a new thread starts on device 0), or None without CUDA."""
    return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
