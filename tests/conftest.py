"""Session-wide test settings.

Each test session compiles into its own Inductor cache: kernels cached by a run under the AVX2 emulation
(`ATEN_CPU_CAPABILITY=avx2`) were loaded by a later default-numerics run on the same machine and returned wrong
values (tests/engine/test_logprobs.py::test_fused_pieces_compile_on_cpu, 2026-12-01).
The PPO batch contract (`hybridflow/protocol/keys.py`) is checked at every stage of every test, set here at import
so xdist workers and the processes tests start inherit it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator

import pytest

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="hybridflow_inductor_")
os.environ.setdefault("HYBRIDFLOW_CHECK_BATCH", "1")  # =0 to time a run without the checks


@pytest.fixture(scope="module")
def dist_group() -> Iterator[None]:
    """A 1-rank gloo process group for tests that build a TrainEngine (FSDP2), reused if one exists; one intra-op
    thread meanwhile (tiny matmuls are much slower with 2 spinning threads on a busy 2-core machine)."""
    import torch
    import torch.distributed as dist

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def no_ray_across_modules() -> Iterator[None]:
    """A Ray instance a test module started stops with the module: otherwise the next module on the same xdist
    worker silently joins it and gets its resources (a 2-CPU cluster where the module asked for 4), whatever the
    order files are handed out in."""
    yield
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


@pytest.fixture(scope="module")
def one_ray_cluster() -> Iterator[None]:
    """One local Ray cluster for a module's tests: the first trainer starts it (`init_ray` with the trainer's
    settings), later ones join it, and it stops after the module's last test. A start and stop cost 5-30 s on
    a 2-core box; tests that need other cluster settings start their own."""
    yield
    import ray

    ray.shutdown()


def pytest_collection_modifyitems(config, items) -> None:
    """Test files in order of expected cost: files with more `slow` tests first, then files with more `ray` tests
    (each starts a cluster and worker processes: 40-160 s per file under the suite's load), then files with more
    tests; tests keep their order inside a file. `make test` hands files out in this order (`--dist loadfile
    --no-loadscope-reorder`), so the two workers start on the long files and end on short ones. Ordered by test
    count alone (xdist's default) the one- and two-test end-to-end files came last, and ordered by `slow` then count
    the two-test Ray files did (test_run_status_ray, test_multinode_ray): a long file last leaves the other worker
    idle."""
    slow: dict[str, int] = {}
    ray: dict[str, int] = {}
    count: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        count[path] = count.get(path, 0) + 1
        slow[path] = slow.get(path, 0) + (item.get_closest_marker("slow") is not None)
        ray[path] = ray.get(path, 0) + (item.get_closest_marker("ray") is not None)
    first = {path: i for i, path in enumerate(count)}
    items.sort(key=lambda item: (-slow[p := item.nodeid.split("::", 1)[0]], -ray[p], -count[p], first[p]))
