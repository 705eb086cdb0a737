"""Controller overheads: empty-call round trip, a 16 MiB DataProto through DP_COMPUTE_PROTO, group start-up.

    .venv/bin/python benchmarks/controller.py                 # local + Ray with 2 and 4 workers (CPU, gloo)
    .venv/bin/python benchmarks/controller.py --workers 2 --calls 200 --json out.json

Targets: local dispatch < 0.1 ms, Ray empty call <= 2 ms on one node, group start <= 5 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from hybridflow.controller import Dispatch, ResourcePool, Worker, WorkerGroup, register
from hybridflow.protocol import DataProto

ROWS = 1024


class BenchWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def noop(self) -> None:
        return None

    @register(Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return data

    @register(Dispatch.DP_COMPUTE_METRIC)
    def consume(self, data: DataProto) -> int:
        return len(data)

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def make(self, data: DataProto, cols: int) -> DataProto:
        """Build a big batch worker-side (rows of `data` × cols float32) for the chained-future measurement."""
        return DataProto.from_single_dict({"x": torch.ones(len(data), cols)})


def _timed(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return {"mean_ms": statistics.fmean(samples), "p50_ms": statistics.median(samples), "n": repeat}


def _big_batch(mib: int) -> DataProto:
    cols = mib * 2**20 // 4 // ROWS
    return DataProto.from_single_dict({"x": torch.randn(ROWS, cols)})


def bench_group(backend: str, workers: int, calls: int, mib: int, pool_kwargs: dict[str, Any]) -> dict[str, Any]:
    pool = ResourcePool([workers], max_colocate_count=2, **pool_kwargs)
    start = time.perf_counter()
    wg = WorkerGroup(pool, BenchWorker, backend=backend, name=f"bench_{backend}_{workers}")
    wg.noop()
    result: dict[str, Any] = {"backend": backend, "workers": workers,
                              "group_start_to_first_call_s": time.perf_counter() - start}
    empty = _timed(wg.noop, calls)
    result["empty_call"] = empty
    big = _big_batch(mib)
    reps = max(5, calls // 20)
    result[f"dp_proto_{mib}mib_roundtrip"] = _timed(lambda: wg.echo(big), reps)
    result[f"dp_proto_{mib}mib_in_only"] = _timed(lambda: wg.consume(big), reps)
    # a second group on the same pool; the batch moves producer → consumer without touching the driver
    second = WorkerGroup(pool, BenchWorker, backend=backend, name=f"bench2_{backend}_{workers}")
    rows = DataProto.from_single_dict({"i": torch.arange(ROWS)})
    cols = big.batch["x"].shape[1]
    result[f"chain_{mib}mib_by_reference"] = _timed(lambda: second.consume(wg.make(rows, cols)), reps)
    result[f"chain_{mib}mib_via_driver"] = _timed(lambda: second.consume(wg.make(rows, cols).get()), reps)
    second.shutdown()
    wg.shutdown()
    pool.release()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="*", default=[2, 4], help="Ray group sizes")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--no-ray", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()

    results: dict[str, Any] = {"machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
                               "torch": torch.__version__, "runs": []}
    local = bench_group("local", 1, calls=max(args.calls, 20000), mib=args.mib, pool_kwargs={"use_gpu": False})
    results["runs"].append(local)
    if not args.no_ray:
        from hybridflow.controller.backends.ray import init_ray

        start = time.perf_counter()
        init_ray(num_cpus=max(8, 2 * max(args.workers)))
        results["ray_init_s"] = time.perf_counter() - start
        for n in args.workers:
            results["runs"].append(bench_group("ray", n, args.calls, args.mib, {"use_gpu": False}))

    print(f"machine: {results['machine']}, torch {results['torch']}")
    if "ray_init_s" in results:
        print(f"ray.init: {results['ray_init_s']:.2f} s")
    for run in results["runs"]:
        print(f"\n[{run['backend']} × {run['workers']}] group start → first call: "
              f"{run['group_start_to_first_call_s']:.3f} s")
        for key, value in run.items():
            if isinstance(value, dict):
                print(f"  {key:32s} mean {value['mean_ms']:9.4f} ms   p50 {value['p50_ms']:9.4f} ms   (n={value['n']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
