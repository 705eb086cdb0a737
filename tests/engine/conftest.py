"""Fixture for engine tests: a 1-rank gloo process group, and one intra-op thread (tiny matmuls are much
slower with 2 spinning threads on a busy 2-core machine)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="module")
def dist_group():
    """A 1-rank gloo process group (reused if a group already exists)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()
    torch.set_num_threads(threads)
