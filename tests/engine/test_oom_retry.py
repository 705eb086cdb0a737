"""An out-of-memory in a training micro-batch (one CUDA rank) halves the micro-batch once and re-runs the mini-batch
from zeroed gradients: the update equals one made at the halved size from the start. Simulated on CPU by raising
`torch.cuda.OutOfMemoryError` from the first accumulation and allowing the retry as on one GPU."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.engine.engine_testlib import make_batch, make_engine, nll_loss, train_step

pytestmark = pytest.mark.usefixtures("dist_group")


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def test_oom_halves_the_micro_batch_once_and_equals_the_smaller_size(monkeypatch, caplog) -> None:
    data = make_batch(8)
    ref = make_engine("actor.ppo_micro_batch_size_per_gpu=4")
    train_step(ref, data, nll_loss)

    engine = make_engine("actor.ppo_micro_batch_size_per_gpu=8")
    real = engine._accumulate
    sizes = []

    def flaky(batch, loss_fn, head, norm, batching, *rest):
        sizes.append(batching.size)
        if len(sizes) == 1:
            real(batch, loss_fn, head, norm, batching, *rest)  # leaves partial gradients behind, as a real OOM would
            raise torch.cuda.OutOfMemoryError("simulated")
        return real(batch, loss_fn, head, norm, batching, *rest)

    monkeypatch.setattr(engine, "_accumulate", flaky)
    monkeypatch.setattr(engine, "_may_retry_oom", lambda b: engine._train_micro_override is None and b.size > 1)
    with caplog.at_level(logging.WARNING):
        train_step(engine, data, nll_loss)
    assert sizes == [8, 4] and engine._train_micro_override == 4
    assert "out of memory at 8 samples" in caplog.text
    for a, b in zip(_params(engine), _params(ref)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_second_oom_or_a_cpu_engine_raises(monkeypatch) -> None:
    engine = make_engine("actor.ppo_micro_batch_size_per_gpu=8")
    assert not engine._may_retry_oom(engine.spec.train_batching)  # CPU: no retry

    def always(*args):
        raise torch.cuda.OutOfMemoryError("simulated")

    monkeypatch.setattr(engine, "_accumulate", always)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        train_step(engine, make_batch(8), nll_loss)
