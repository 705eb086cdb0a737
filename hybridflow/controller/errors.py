"""Errors a driver sees when a worker-group call fails: they name the group, the method and the rank."""

from __future__ import annotations

from hybridflow.utils.progress import current_stage


class WorkerError(RuntimeError):
    """A worker raised, or its process died, during a group call. `remote_traceback` is the worker's text; `node`
    the Ray node the rank ran on (when the backend knows it); `stage` the driver's stage when the call failed
    (`gen`, `update_actor`, ...; empty outside the training step)."""

    def __init__(self, group: str, method: str, rank: int, detail: str, remote_traceback: str = "", node: str = "",
                 stage: str | None = None) -> None:
        self.group, self.method, self.rank = group, method, rank
        self.detail, self.remote_traceback, self.node = detail, remote_traceback, node
        self.stage = current_stage() if stage is None else stage
        where = (f" on node {node}" if node else "") + (f" in stage {self.stage!r}" if self.stage else "")
        message = f"worker group {group!r}, method {method!r}, rank {rank}{where}: {detail}"
        if remote_traceback:
            message += f"\n--- remote traceback (rank {rank}) ---\n{remote_traceback.rstrip()}"
        super().__init__(message)

    def __reduce__(self):  # keep all fields through pickling
        return (type(self), (self.group, self.method, self.rank, self.detail, self.remote_traceback, self.node,
                             self.stage))


class WorkerTimeoutError(TimeoutError):
    """A group call did not finish within its timeout; `pending_ranks` had not answered."""

    def __init__(self, group: str, method: str, timeout_s: float, pending_ranks: list[int]) -> None:
        self.group, self.method, self.timeout_s, self.pending_ranks = group, method, timeout_s, pending_ranks
        super().__init__(f"worker group {group!r}, method {method!r}: no answer from rank(s) {pending_ranks} "
                         f"within {timeout_s:g} s (raise the timeout with register(timeout_s=...) or "
                         f"WorkerGroup.default_timeout_s, or look for a hung collective)")

    def __reduce__(self):
        return (type(self), (self.group, self.method, self.timeout_s, self.pending_ranks))


class RemoteCallError(Exception):
    """Raised inside a worker process to carry the formatted traceback of the user's exception to the driver."""

    def __init__(self, rank: int, summary: str, traceback_text: str) -> None:
        self.rank, self.summary, self.traceback_text = rank, summary, traceback_text
        super().__init__(f"rank {rank}: {summary}")

    def __reduce__(self):
        return (type(self), (self.rank, self.summary, self.traceback_text))


class HangError(RuntimeError):
    """The hang watchdog saw no progress for `timeout_s` (trainer.hang_timeout_s) in `stage` on `rank` (-1: the
    driver itself); every rank's Python stacks are in `dump_dir`."""

    def __init__(self, stage: str, rank: int, group: str, method: str, timeout_s: float, dump_dir: str,
                 detail: str = "") -> None:
        self.stage, self.rank, self.group, self.method = stage, rank, group, method
        self.timeout_s, self.dump_dir, self.detail = timeout_s, dump_dir, detail
        where = "the driver" if rank < 0 else f"rank {rank}"
        call = f" (worker group {group!r}, method {method!r}{detail})" if group else detail
        super().__init__(f"hang in {stage} on {where}{call}: no progress for {timeout_s:g} s; Python stacks of "
                         f"every rank and the driver are in {dump_dir}/ (raise trainer.hang_timeout_s if this stage "
                         f"is legitimately this slow; 0 turns the watchdog off)")

    def __reduce__(self):
        return (type(self), (self.stage, self.rank, self.group, self.method, self.timeout_s, self.dump_dir,
                             self.detail))
