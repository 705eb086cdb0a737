"""GPU check of `Worker.init_distributed` without Ray: N processes (one per GPU) all-reduce over NCCL, plus a
world-size-1 local group joining NCCL through the in-memory store. Prints timings; exits non-zero on a wrong sum.

    python benchmarks/controller_nccl.py            # uses every visible GPU (needs >= 1)
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridflow.controller import Dispatch, Worker, WorkerEnv, WorkerGroup, register
from hybridflow.controller.worker import WORKER_BASE_ENV, find_free_port, worker_env


class NcclWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def all_reduce(self, value: float) -> tuple[float, str, float]:
        start = time.perf_counter()
        self.init_distributed()
        init_s = time.perf_counter() - start
        t = torch.full((1024,), value + self.rank, device=self.device)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        return float(t[0].item()), str(self.device), init_s


def _rank_main(rank: int, world: int, port: int, queue: mp.Queue) -> None:
    os.environ.update(WORKER_BASE_ENV)
    with worker_env(WorkerEnv(rank, world, rank, world, "127.0.0.1", port)):
        worker = NcclWorker()
    queue.put((rank, *worker.all_reduce(1.0)))
    dist.destroy_process_group()


def main() -> int:
    n = torch.cuda.device_count()
    if n == 0:
        print("no GPU visible")
        return 1
    os.environ.update(WORKER_BASE_ENV)
    wg = WorkerGroup(None, NcclWorker, backend="local")
    value, device, init_s = wg.all_reduce(1.0)[0]
    print(f"local group, world 1: all_reduce={value} on {device}, init_distributed {init_s * 1e3:.1f} ms")
    ok = value == 1.0
    dist.destroy_process_group()
    if n >= 2:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        port = find_free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, n, port, queue)) for r in range(n)]
        for p in procs:
            p.start()
        results = sorted(queue.get(timeout=300) for _ in procs)
        for p in procs:
            p.join()
        expected = sum(1.0 + r for r in range(n))
        for rank, total, dev, init_s in results:
            print(f"rank {rank}/{n}: all_reduce={total} (expected {expected}) on {dev}, init {init_s:.2f} s")
            ok &= total == expected
    print("OK" if ok else "WRONG SUM")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
