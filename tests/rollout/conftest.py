"""Fixtures for rollout tests (builders live in rollout_helpers.py: a unique module name, unlike conftest)."""

from __future__ import annotations

import pytest
import torch
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
def gloo(dist_group):
    """The 1-rank gloo process group (tests/conftest.py `dist_group`), under the name rollout tests use."""
    yield
