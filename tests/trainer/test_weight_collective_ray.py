"""trainer.weight_sync.transport=collective on Ray (gloo on CPU): the weights reach the rollout worker bit-exact over
the weight group while one_step_off trains, and a rollout worker that dies in the middle of a broadcast stops the
run with an error naming it — no hang."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from ppo_testlib import tiny_ppo_config

ray = pytest.importorskip("ray")

from hybridflow.controller import WorkerError  # noqa: E402
from hybridflow.trainer.async_driver import RolloutWorkerFailed  # noqa: E402
from hybridflow.trainer.ppo import PPOTrainer  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120), pytest.mark.usefixtures("one_ray_cluster")]  # tests/conftest.py

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _cfg(tmp_path: Path, *extra: str) -> Any:
    return tiny_ppo_config(tmp_path, tmp_path / "ckpt", 2, "trainer.backend=ray", "trainer.mode=one_step_off",
                           "trainer.logger=[]", f"trainer.run_dir={tmp_path}/run", "trainer.resume_mode=disable",
                           "trainer.checkpoint.save_freq=0", "trainer.weight_sync.bucket_mb=0.02", *extra)


def _die_mid_broadcast(host: Any, seq: int) -> None:
    """Inside the rollout worker's process: exit after the first bucket of broadcast `seq`."""
    import hybridflow.workers.weight_collective as wc

    receive, broadcast = wc.WeightReceiver.receive, wc._broadcast
    state = {"armed": False, "buckets": 0}

    def arming_receive(self: Any, msg: Any) -> Any:
        state["armed"] = msg.seq == seq
        return receive(self, msg)

    def dying_broadcast(group: Any, tensor: Any, timeout: Any) -> None:
        if state["armed"]:
            state["buckets"] += 1
            if state["buckets"] == 2:
                os._exit(1)
        broadcast(group, tensor, timeout)

    wc.WeightReceiver.receive, wc._broadcast = arming_receive, dying_broadcast


def _sender_error(host: Any) -> str:
    sender = host.worker.roles["actor_rollout_ref"]._weight_sender
    return repr(sender._error)


def test_one_step_off_broadcasts_bit_exact_weights(tmp_path: Path) -> None:
    trainer = PPOTrainer(_cfg(tmp_path, "trainer.total_training_steps=3"))  # transport auto: collective on Ray
    try:
        assert trainer.algorithm.driver.transport.name == "collective"
        assert trainer.algorithm.driver.transport.backend == "gloo"
        history = [m for m in trainer.fit() if m.get("training/global_step", 0) >= 1]
        sent = trainer.groups.actor.weight_buckets(1 << 30)[0]
        held = trainer.groups.rollout.weights()[0]  # queued behind the last receive_weights: version 3
        version = trainer.groups.rollout.policy_version()[0]
    finally:
        trainer.close()
    assert len(history) == 3 and version == 3
    names = [n for b in sent for n, _ in b.tensors()]
    assert sorted(names) == sorted(held)
    for bucket in sent:
        for name, t in bucket.tensors():
            assert held[name].dtype == t.dtype and torch_equal_bits(held[name], t), name
    for m in history:
        assert m["weight_sync/collective"] == 1.0 and m["weight_sync/buckets"] > 1 and m["weight_sync/bytes"] > 0
        assert m["timing/weight_sync"] >= 0
    assert sum(m.get("weight_sync/broadcasts_done", 0.0) for m in history) >= 2  # reported by the sender
    assert any(m.get("weight_sync/rollout_recv_s", -1.0) >= 0 for m in history)  # and by the receiver


def torch_equal_bits(a: Any, b: Any) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_rollout_worker_dying_mid_broadcast_is_named_and_nothing_hangs(tmp_path: Path) -> None:
    trainer = PPOTrainer(_cfg(tmp_path, "trainer.total_training_steps=4", "trainer.weight_sync.timeout_s=20"))
    rollout_handle = trainer.groups.rollout.worker_group._handles[0]  # noqa: SLF001 - reach into the Ray backend
    trainer_handle = trainer.groups.owners[0]._handles[0]  # noqa: SLF001
    # broadcast 1 = the weights at start, 2 = after step 1: the worker dies halfway through it
    ray.get(rollout_handle.__ray_call__.remote(_die_mid_broadcast, 2), timeout=60)
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerError) as info:
            trainer.fit()
        took = time.monotonic() - t0
        deadline = time.monotonic() + 10
        while (sender_error := ray.get(trainer_handle.__ray_call__.remote(_sender_error), timeout=30)) == "None" \
                and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        trainer.close()
    err = info.value
    assert isinstance(err, RolloutWorkerFailed), repr(err)
    assert err.group == "rollout" and err.rank == 0, str(err)
    assert err.method in ("receive_weights", "generate_sequences"), str(err)  # the first, when Ray has both
    assert "trainer.mode=one_step_off" in str(err)
    assert took < 60, f"the failure took {took:.0f} s to surface"
    # the trainer's sender saw the broken broadcast (the peer's closed connection), well before its 20 s timeout
    assert "Connection closed by peer" in sender_error or "Connection reset" in sender_error, sender_error
