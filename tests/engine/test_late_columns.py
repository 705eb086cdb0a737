"""Late columns (`protocol.late`): an update whose loss column arrives after the first micro-batch's forward was
queued equals the update with the column present from the start, also with shuffled rows; the engine waits for it
only once, after that first forward; an update of several mini-batches refuses it."""

import pytest
import torch
from engine_testlib import head_of, make_batch, make_engine

from hybridflow.engine import TrainEngine, UpdatePlan, train_update
from hybridflow.protocol import DataProto

pytestmark = pytest.mark.usefixtures("dist_group")


def weighted_nll(outputs, mb, norm):
    """Token-mean NLL with a per-row weight: the loss reads a column, as the actor's reads the advantages."""
    w = mb.batch["row_weight"]
    loss = -(outputs["log_probs"] * w[:, None] * mb.batch["response_mask"]).sum() / norm["token-mean"]
    return loss, {"nll_share": loss.detach()}


def _data() -> DataProto:
    data = make_batch(seed=11)
    data.batch["row_weight"] = torch.linspace(0.2, 2.0, len(data))
    return data


@pytest.mark.parametrize("shuffle", [False, True])
def test_late_column_update_equals_the_update_with_the_column(shuffle, monkeypatch):
    overrides = ("actor.ppo_micro_batch_size_per_gpu=4", f"actor.shuffle={str(shuffle).lower()}")
    full, early = _data(), make_engine(*overrides)
    m_full = train_update(early, full, weighted_nll, head_of(early), UpdatePlan(len(full), 1, shuffle, seed=3))

    engine = make_engine(*overrides)
    events = []
    forward = TrainEngine._forward_micro

    def spy(self, *args, **kwargs):
        events.append("forward")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(TrainEngine, "_forward_micro", spy)

    def late():
        events.append("late")
        return _data()

    partial = _data().select([k for k in full.batch if k != "row_weight"], [], [])
    m_late = train_update(engine, partial, weighted_nll, head_of(engine), UpdatePlan(len(full), 1, shuffle, seed=3),
                          late=late)
    assert events == ["forward", "late", "forward"]
    assert m_late["loss"] == m_full["loss"]
    for a, b in zip(early.module.parameters(), engine.module.parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor())


def test_late_columns_need_one_mini_batch_and_one_epoch():
    engine = make_engine()
    data = _data()
    with pytest.raises(ValueError, match="one mini-batch and one epoch"):
        train_update(engine, data, weighted_nll, head_of(engine), UpdatePlan(len(data) // 2), late=lambda: data)
    with pytest.raises(ValueError, match="one mini-batch and one epoch"):
        train_update(engine, data, weighted_nll, head_of(engine), UpdatePlan(len(data), 2), late=lambda: data)


def test_the_late_functions_host_time_is_not_the_updates_on_the_cpu():
    import time

    engine = make_engine()
    full = _data()
    partial = full.select([k for k in full.batch if k != "row_weight"], [], [])

    def slow():
        time.sleep(2.0)
        return _data()

    metrics = train_update(engine, partial, weighted_nll, head_of(engine), UpdatePlan(len(full)), late=slow)
    assert 0 < metrics["step_time_s"] < 2.0


def test_a_late_column_that_changed_a_column_the_update_read_is_refused():
    engine = make_engine()
    full = _data()
    partial = full.select([k for k in full.batch if k != "row_weight"], [], [])

    def changed():
        out = _data()
        out.batch["response_mask"] = out.batch["response_mask"].clone()
        out.batch["response_mask"][0, 0] = 1 - out.batch["response_mask"][0, 0]
        return out

    with pytest.raises(ValueError, match="'response_mask' differs"):
        train_update(engine, partial, weighted_nll, head_of(engine), UpdatePlan(len(full)), late=changed)
