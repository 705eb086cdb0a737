"""Fixtures for rollout tests (builders live in rollout_helpers.py: a unique module name, unlike conftest)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from rollout_helpers import make_model


@pytest.fixture(params=["tiny", "qwen"])
def model(request):
    return make_model(request.param)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a loaded 2-core box OpenMP spin-waits make them
    up to 40x slower; restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def gloo():
    """A 1-rank gloo process group for tests that build a TrainEngine (FSDP2); reused if one exists."""
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    if own:
        dist.destroy_process_group()
