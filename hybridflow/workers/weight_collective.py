"""The `collective` weight transport (`trainer.weight_sync.transport`): actor rank 0 broadcasts the flat weight
buckets to every rollout rank over a process group of their own — NCCL when every member holds CUDA tensors,
gloo otherwise.

The group is built once, at start-up, from a `TCPStore` the sender hosts and a `ProcessGroupGloo` /
`ProcessGroupNCCL` object constructed directly, not `init_process_group` / `new_group`: the trainer's ranks already
have a default group (FSDP) that the rollout workers are not in, and this group must leave it alone. Group rank 0
is the sender, rank 1 + r the rollout worker of rank r; the members agree on the backend through the store (each
receiver posts its device, the sender posts the choice): NCCL needs every member on a GPU of its own, so members
that share one (trainer and rollout on one GPU, separate processes) fall back to gloo through host memory.

Per update the control message (`CollectiveWeights`: a sequence number and the `BucketSpec`s) goes through the
normal worker call and the tensors through the group, bucket by bucket, into buffers the receiver allocates once
and reuses. The sender broadcasts from a thread of its own, so the trainer never waits for a rollout worker to
finish the generate requests queued ahead of its `receive_weights`. A broadcast starts only once every receiver has
announced itself in the store (`ready/<seq>`), so the group's timeout (`trainer.weight_sync.timeout_s`) bounds the
transfer, not the generation ahead of it: a receiver that dies mid-broadcast fails the sender at once (gloo: the
peer closed the connection), one that hangs after that timeout — never a hang.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridflow.workers.weight_sync import BucketSpec, WeightBucket

logger = logging.getLogger(__name__)

_GROUP_PREFIX = "hybridflow/weights/pg/"  # the process group's keys, apart from ours (device/, backend, ready/)


@dataclass(frozen=True)
class CollectiveWeights:
    """The control message of one broadcast: its number (1, 2, ...; receivers check they are in step) and layout."""

    seq: int
    specs: tuple[BucketSpec, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.numel * s.dtype.itemsize for s in self.specs)


@dataclass(frozen=True)
class BroadcastStats:
    """One finished broadcast, as the sender saw it: seconds waiting for the receivers, then transferring."""

    seq: int
    wait_s: float
    broadcast_s: float
    nbytes: int


def _process_group(store: dist.Store, rank: int, size: int, backend: str, timeout: timedelta) -> dist.Backend:
    prefixed = dist.PrefixStore(_GROUP_PREFIX, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = False
        opts._timeout = timeout  # the options' field (torch's own new_group sets it the same way)
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    raise ValueError(f"weight group backend {backend!r}: expected 'gloo' or 'nccl'")


def _broadcast(group: dist.Backend, tensor: torch.Tensor, timeout: timedelta) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, timeout
    group.broadcast([tensor], opts).wait()


def _device_key(device: torch.device) -> str:
    """`cpu`, or `cuda:<the GPU's UUID>` (which physical GPU: each Ray actor calls its own GPU cuda:0)."""
    if device.type != "cuda":
        return device.type
    return f"cuda:{torch.cuda.get_device_properties(device).uuid}"


def group_backend(devices: list[str]) -> str:
    """nccl when every member is on a GPU of its own (`_device_key`s), else gloo."""
    on_gpus = all(d.startswith("cuda:") for d in devices)
    return "nccl" if on_gpus and len(set(devices)) == len(devices) else "gloo"


def _cuda_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A side stream for the transfers on `device` (they run in a thread beside the worker's own kernels)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


class WeightSender:
    """Actor rank 0: hosts the group's store; `put` queues a bucket set and returns its control message; a thread
    builds the group, then broadcasts the sets in order. A failure is kept and raised by the next `put`."""

    def __init__(self, host: str, n_receivers: int, device: torch.device, timeout_s: float) -> None:
        if n_receivers < 1:
            raise ValueError(f"weight group: n_receivers={n_receivers}, expected >= 1 rollout worker")
        self.timeout = timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout)
        self.address = (host, int(self.store.port))
        self.size, self.device = n_receivers + 1, device
        self.backend: str | None = None
        self._seq = 0
        self._queue: queue.SimpleQueue[tuple[int, list[WeightBucket]] | None] = queue.SimpleQueue()
        self._finished: list[BroadcastStats] = []
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridflow-weight-sender", daemon=True)
        self._thread.start()

    def put(self, buckets: list[WeightBucket]) -> CollectiveWeights:
        self.raise_if_failed()
        self._seq += 1
        self._queue.put((self._seq, buckets))
        return CollectiveWeights(self._seq, tuple(b.spec for b in buckets))

    def finished(self) -> list[BroadcastStats]:
        """The broadcasts finished since the last call."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"the weight broadcast from actor rank 0 to the rollout workers failed ({self.backend or 'unbuilt'} "
                f"group of {self.size}, trainer.weight_sync.timeout_s={self.timeout.total_seconds():g}): "
                f"{self._error!r}; a rollout worker died, hung or left the group") from self._error

    def close(self) -> None:
        self._closed.set()
        self._queue.put(None)
        self._thread.join(timeout=5.0)

    # ------------------------------------------------------------------------------------------ thread
    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # the current device is per thread
            stream = _cuda_stream(self.device)
            group = self._build()
            while (item := self._queue.get()) is not None:
                seq, buckets = item
                t0 = time.perf_counter()
                if not self._await_ready(seq):
                    return
                t1 = time.perf_counter()
                for bucket in buckets:
                    self._send(group, bucket.flat, stream)
                stats = BroadcastStats(seq, t1 - t0, time.perf_counter() - t1, sum(b.nbytes for b in buckets))
                with self._lock:
                    self._finished.append(stats)
        except BaseException as err:  # kept for the trainer's next put (this thread has nobody to raise to)
            self._error = err
            logger.error("weight sender: %r", err)

    def _build(self) -> dist.Backend:
        """Read every receiver's device, post the backend, join the group (gloo: waits for every member)."""
        devices = [_device_key(self.device)] + [self.store.get(f"device/{r}").decode() for r in range(1, self.size)]
        self.backend = group_backend(devices)
        if self.backend == "gloo" and any(d.startswith("cuda") for d in devices):
            logger.warning("weight group: gloo through host memory, since NCCL needs every member on a GPU of its "
                           "own (devices: %s)", devices)
        self.store.set("backend", self.backend)
        return _process_group(self.store, 0, self.size, self.backend, self.timeout)

    def _await_ready(self, seq: int) -> bool:
        """Poll the store until every receiver has entered its receive of `seq` (False: closed meanwhile)."""
        delay = 1e-3
        while not self._closed.is_set():
            if self.store.add(f"ready/{seq}", 0) >= self.size - 1:
                return True
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        return False

    def _send(self, group: dist.Backend, flat: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
        if self.backend == "nccl":
            assert stream is not None, "nccl weight group without a CUDA stream"
            with torch.cuda.stream(stream):
                _broadcast(group, flat.to(self.device, non_blocking=False), self.timeout)
            stream.synchronize()  # one bucket on the GPU at a time; its staging copy is freed after
        else:
            _broadcast(group, flat.to("cpu").contiguous(), self.timeout)


class WeightReceiver:
    """A rollout worker's end (group rank `rank` ≥ 1): joins the group in the constructor (blocks until every member
    has), then `receive` takes one broadcast into its reused buffers."""

    def __init__(self, address: tuple[str, int], rank: int, size: int, device: torch.device,
                 timeout_s: float) -> None:
        self.timeout = timedelta(seconds=timeout_s)
        host, port = address
        self.store = dist.TCPStore(host, port, is_master=False, timeout=self.timeout)
        self.store.set(f"device/{rank}", _device_key(device))
        self.backend = self.store.get("backend").decode()
        self.device = device
        self._buffer_device = device if self.backend == "nccl" else torch.device("cpu")
        self._stream = _cuda_stream(device) if self.backend == "nccl" else None
        self.group = _process_group(self.store, rank, size, self.backend, self.timeout)
        self.seq = 0
        self._layout: tuple[BucketSpec, ...] = ()
        self._buffers: list[torch.Tensor] = []

    def receive(self, msg: CollectiveWeights) -> tuple[list[WeightBucket], float]:
        """The buckets of broadcast `msg.seq` (views of this receiver's buffers: valid until the next receive) and
        the seconds the transfer took."""
        if msg.seq != self.seq + 1:
            raise RuntimeError(f"weight group: broadcast {msg.seq} arrived after {self.seq}; the rollout worker "
                               "missed a weight sync (its calls must run in the order the driver sent them)")
        self.seq = msg.seq
        buffers = self._buffers_for(msg.specs)
        self.store.add(f"ready/{msg.seq}", 1)
        t0 = time.perf_counter()
        if self._stream is not None:
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                for buf in buffers:
                    _broadcast(self.group, buf, self.timeout)
            self._stream.synchronize()
        else:
            for buf in buffers:
                _broadcast(self.group, buf, self.timeout)
        return [WeightBucket.from_spec(s, b) for s, b in zip(msg.specs, buffers)], time.perf_counter() - t0

    def _buffers_for(self, specs: tuple[BucketSpec, ...]) -> list[torch.Tensor]:
        if specs != self._layout:  # the first broadcast (the layout never changes within a run)
            self._buffers = [torch.empty(s.numel, dtype=s.dtype, device=self._buffer_device) for s in specs]
            self._layout = specs
        return self._buffers
