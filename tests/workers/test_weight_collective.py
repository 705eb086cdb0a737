"""The weight group of `trainer.weight_sync.transport=collective` (workers/weight_collective.py), its members as
threads of one process over gloo: bit-exact buckets, reused buffers, a sender that waits for its receivers instead
of timing out, and a receiver that dies or hangs mid-broadcast failing the sender within the group's timeout."""

from __future__ import annotations

import functools
import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from hybridflow.workers.weight_collective import (
    CollectiveWeights,
    WeightReceiver,
    WeightSender,
    group_backend,
)
from hybridflow.workers.weight_sync import WeightBucket, pack_buckets

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [("embed.weight", torch.randn(64, 16, generator=g)), ("norm.weight", torch.randn(16, generator=g)),
            ("proj.weight", torch.randn(16, 16, generator=g).to(torch.bfloat16)),
            ("head.weight", torch.randn(64, 16, generator=g))]


def _group(n: int, timeout_s: float) -> tuple[WeightSender, list[WeightReceiver]]:
    sender = WeightSender("127.0.0.1", n, CPU, timeout_s)
    receivers: list[Any] = [None] * n

    def join(r: int) -> None:
        receivers[r] = WeightReceiver(sender.address, 1 + r, n + 1, CPU, timeout_s)

    threads = [threading.Thread(target=join, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(r is not None for r in receivers), "a receiver did not join the group"
    return sender, receivers


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test, which asserts on it
            out["error"] = err

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _wait_failed(sender: WeightSender, within_s: float) -> RuntimeError:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            sender.raise_if_failed()
        except RuntimeError as err:
            return err
        time.sleep(0.01)
    raise AssertionError(f"the sender did not fail within {within_s} s")


def test_broadcast_is_bit_exact_and_reuses_the_receivers_buffers() -> None:
    sender, receivers = _group(2, timeout_s=30)
    try:
        assert sender.backend == "gloo" and all(r.backend == "gloo" for r in receivers)
        for seed in (1, 2):
            sent = pack_buckets(_weights(seed), bucket_bytes=3000)  # several buckets, a new one at each dtype change
            assert len(sent) >= 3 and {b.flat.dtype for b in sent} == {torch.float32, torch.bfloat16}
            msg = sender.put(sent)
            assert isinstance(msg, CollectiveWeights) and msg.seq == seed
            assert msg.nbytes == sum(b.nbytes for b in sent)
            first_buffers = [b.data_ptr() for b in receivers[0]._buffers]
            # one receiver arrives late (a generate call ahead of it): the sender waits for it, not its timeout
            jobs = [_in_thread(functools.partial(receivers[0].receive, msg))]
            time.sleep(0.3)
            jobs.append(_in_thread(functools.partial(receivers[1].receive, msg)))
            for t, out in jobs:
                t.join(timeout=30)
                assert "error" not in out, out.get("error")
                got, seconds = out["value"]
                assert seconds >= 0 and len(got) == len(sent)
                for a, b in zip(sent, got):
                    assert a.names == b.names and a.shapes == b.shapes
                    assert torch.equal(a.flat.view(torch.uint8), b.flat.view(torch.uint8))  # bits, not values
            if seed == 2:  # the same layout: the same buffers
                assert [b.data_ptr() for b in receivers[0]._buffers] == first_buffers
        deadline = time.monotonic() + 10
        done: list[Any] = []
        while len(done) < 2 and time.monotonic() < deadline:
            done += sender.finished()
            time.sleep(0.01)
        assert [s.seq for s in done] == [1, 2]
        assert done[0].wait_s < 1.0 and done[1].wait_s >= 0.25  # the second waited for its late receiver
        assert all(s.nbytes == msg.nbytes for s in done)
    finally:
        sender.close()


def test_a_receiver_out_of_step_is_refused() -> None:
    sender, (receiver,) = _group(1, timeout_s=30)
    try:
        msg = CollectiveWeights(2, tuple(b.spec for b in pack_buckets(_weights(0), 1 << 20)))
        with pytest.raises(RuntimeError, match="broadcast 2 arrived after 0"):
            receiver.receive(msg)
    finally:
        sender.close()


def test_a_receiver_that_dies_mid_broadcast_fails_the_sender_at_once() -> None:
    sender, receivers = _group(2, timeout_s=6)
    try:
        sent = pack_buckets(_weights(3), bucket_bytes=3000)
        msg = sender.put(sent)
        alive_t, alive = _in_thread(lambda: receivers[0].receive(msg))
        # the other receiver announces itself, takes the first bucket, and its process "dies": its group closes
        dying = receivers[1]
        dying.store.add(f"ready/{msg.seq}", 1)
        first = torch.empty(msg.specs[0].numel, dtype=msg.specs[0].dtype)
        from hybridflow.workers.weight_collective import _broadcast

        _broadcast(dying.group, first, dying.timeout)
        assert torch.equal(first, sent[0].flat)
        t0 = time.monotonic()
        del dying, receivers[1]
        gc.collect()
        err = _wait_failed(sender, within_s=10)
        assert time.monotonic() - t0 < 3  # the peer's closed connection, not the 6 s timeout
        assert "weight broadcast from actor rank 0 to the rollout workers failed" in str(err)
        with pytest.raises(RuntimeError, match="weight broadcast"):
            sender.put(sent)  # the trainer's next update raises it
        alive_t.join(timeout=20)  # the live receiver, stranded mid-broadcast, fails by the timeout: no hang
        assert not alive_t.is_alive() and isinstance(alive.get("error"), RuntimeError), alive
    finally:
        sender.close()


def test_a_receiver_that_hangs_mid_broadcast_fails_the_sender_after_the_timeout() -> None:
    sender, receivers = _group(1, timeout_s=1.5)
    try:
        msg = sender.put(pack_buckets(_weights(4), bucket_bytes=1 << 20))
        receivers[0].store.add(f"ready/{msg.seq}", 1)  # announced, then never takes part
        t0 = time.monotonic()
        err = _wait_failed(sender, within_s=20)
        assert 1.0 < time.monotonic() - t0 < 20, time.monotonic() - t0
        assert "timeout_s=1.5" in str(err)
    finally:
        sender.close()
        del receivers


def test_bucket_spec_round_trip() -> None:
    bucket = pack_buckets(_weights(5), 1 << 20)[0]
    again = WeightBucket.from_spec(bucket.spec, bucket.flat.clone())
    assert again.names == bucket.names and again.shapes == bucket.shapes
    assert torch.equal(again.flat, bucket.flat)


@pytest.mark.parametrize(("devices", "backend"), [
    (["cuda:GPU-a", "cuda:GPU-b"], "nccl"),
    (["cuda:GPU-a", "cuda:GPU-a"], "gloo"),  # trainer and rollout processes on one GPU: NCCL refuses that
    (["cuda:GPU-a", "cpu"], "gloo"),
    (["cpu", "cpu", "cpu"], "gloo"),
])
def test_backend_is_nccl_only_with_a_gpu_per_member(devices: list[str], backend: str) -> None:
    assert group_backend(devices) == backend
