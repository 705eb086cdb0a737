"""trainer.mode=one_step_off on Ray: the rollout worker is its own process; when it dies mid-run the
trainer stops at once with an error that names the rollout group, the call and the rank — no hang. Async on Ray:
partial rollouts, and a resume that keeps the rollouts generated before a stop."""

from __future__ import annotations

import os
import re
import signal
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

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.usefixtures("one_ray_cluster")]  # tests/conftest.py

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _pid(host: Any) -> int:
    return os.getpid()


def test_killed_rollout_worker_is_named_and_nothing_hangs(tmp_path: Path) -> None:
    cfg = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 2, "trainer.backend=ray", "trainer.mode=one_step_off",
                          "trainer.logger=[]", f"trainer.run_dir={tmp_path}/run", "trainer.total_training_steps=4",
                          "trainer.resume_mode=disable")
    trainer = PPOTrainer(cfg)
    alg = trainer.algorithm
    rollout_handle = trainer.groups.rollout.worker_group._handles[0]  # noqa: SLF001 - reach into the Ray backend
    trainer_pid = ray.get(trainer.groups.owners[0]._handles[0].__ray_call__.remote(_pid), timeout=60)  # noqa: SLF001
    rollout_pid = ray.get(rollout_handle.__ray_call__.remote(_pid), timeout=60)
    assert rollout_pid not in (trainer_pid, os.getpid())  # a process of its own
    step = alg.step
    seen: list[int] = []
    killed: list[float] = []

    def step_then_kill(batch: Any, n: int) -> dict[str, float]:
        out = step(batch, n)
        seen.append(n)
        if n == 2:  # step 3's batch is being generated (or queued) on the rollout worker: kill it
            os.kill(rollout_pid, signal.SIGKILL)
            killed.append(time.monotonic())
        return out

    alg.step = step_then_kill
    try:
        with pytest.raises(WorkerError) as info:
            trainer.fit()
    finally:
        trainer.close()
    err = info.value
    assert isinstance(err, RolloutWorkerFailed), repr(err)
    assert err.group == "rollout" and err.rank == 0, str(err)
    assert "trainer.mode=one_step_off" in str(err), str(err)
    if err.method == "receive_weights":
        # the weights of step 2 (queued behind step 3's batch) were lost; step 3's batch had finished, so step 3
        # trained; what noticed was either step 3's own weight staging (weight_sync.transport=collective, the Ray
        # default: the trainer's broadcast of version 2 broke; step 3 then raised before returning) or step 4's
        # request, queued behind the lost weights
        assert "receiving the weights of policy version 2" in str(err), str(err)[:400]
        assert seen in ([1, 2], [1, 2, 3]), seen
    else:
        assert err.method == "generate_sequences", str(err)
        # step 3's batch may have finished before the kill (then step 3 trains and step 4's generation is lost)
        lost = int(re.search(r"generating for step (\d+)", str(err)).group(1))
        assert lost in (3, 4), str(err)
        assert seen == list(range(1, lost)), (seen, lost)  # no step trained on a batch the dead worker did not finish
    assert time.monotonic() - killed[0] < 60, "the failure took too long to surface"


def test_partial_rollout_continue_takes_weights_mid_generation_on_ray(tmp_path: Path) -> None:
    """partial_rollout=continue: the weights go to the rollout actor's own `weights` thread group, so they reach a
    generate call while it runs (abort mode would queue them behind it); tokens after the swap carry the new
    version and the new weights' log-probs (here a zeroed lm_head: uniform)."""
    import torch

    from hybridflow.protocol import DataProto
    from hybridflow.trainer.roles import build_rollout_group
    from hybridflow.workers.weight_sync import pack_buckets

    cfg = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 4, "trainer.backend=ray", "trainer.mode=async",
                          "trainer.async.partial_rollout=continue", "data.train_batch_size=4",
                          "data.max_response_length=256", "rollout.ignore_eos=true", "trainer.logger=[]",
                          f"trainer.run_dir={tmp_path}/run")
    group, pool = build_rollout_group(cfg)
    try:
        weights = group.weights()[0]
        vocab = weights["lm_head.weight"].shape[0]
        B, P = 8, 6
        ids = torch.randint(3, vocab, (B, P), generator=torch.Generator().manual_seed(0))
        prompts = DataProto.from_single_dict({"input_ids": ids, "attention_mask": torch.ones(B, P, dtype=torch.long),
                                              "position_ids": torch.arange(P).expand(B, P).clone()})
        gen = group.generate_sequences(prompts)  # 8 x 4 rows x 256 tokens, one weight check per decode step
        deadline = time.monotonic() + 60
        while group.progress()[0]["weight_checks"] < 2:  # decoding began (answered while the generate call runs)
            assert time.monotonic() < deadline and not gen.done(), "generation did not start (or ended at once)"
            time.sleep(0.002)
        new = {n: (torch.zeros_like(t) if n == "lm_head.weight" else t) for n, t in weights.items()}
        sync = group.receive_weights_live(pack_buckets(new.items(), 1 << 30), 1)
        assert sync.get()[0]["weight_sync/version"] == 1
        out = gen.get()
    finally:
        group.worker_group.shutdown()
        pool.release()
    versions = out.batch["rollout_policy_version"]
    first_new = (versions == 1).long().argmax(1)
    assert bool((versions[:, 0] == 0).all()) and bool((versions[:, -1] == 1).all()), "every row must span the swap"
    assert len(set(first_new.tolist())) == 1  # all rows decode together: they switch at the same token
    assert out.meta_info["metrics"]["rollout/weight_swaps"] == 1
    t = torch.arange(versions.shape[1])[None]
    assert torch.equal(versions, (t >= first_new[:, None]).long())
    uniform = -float(torch.log(torch.tensor(float(vocab))))
    new_logp = out.batch["rollout_log_probs"][versions == 1]
    torch.testing.assert_close(new_logp, torch.full_like(new_logp, uniform))
    assert float((out.batch["rollout_log_probs"][versions == 0] - uniform).abs().max()) > 0.5


def test_async_continue_trains_on_ray_with_consistent_versions(tmp_path: Path) -> None:
    """The whole path on Ray: the driver sends weights through the rollout actor's `weights` thread group while it
    generates; whatever the timing, every trained token's version is within the bound, versions never decrease
    along a row, and a row's version is its oldest token's."""
    import torch

    cfg = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 4, "trainer.backend=ray", "trainer.mode=async",
                          "trainer.async.partial_rollout=continue", "trainer.async.max_staleness=1",
                          "trainer.async.chunk_prompts=1", "data.train_batch_size=4", "data.max_response_length=32",
                          "trainer.total_training_steps=4", "trainer.logger=[]", f"trainer.run_dir={tmp_path}/run",
                          "trainer.resume_mode=disable", "trainer.checkpoint.save_freq=0")
    trainer = PPOTrainer(cfg)
    rows: list[dict[str, Any]] = []
    reward = trainer.algorithm.reward

    def recording(batch: Any, metrics: dict[str, float]) -> Any:
        rows.append({k: batch.batch[k].clone() for k in ("policy_version", "rollout_policy_version")})
        return reward(batch, metrics)

    trainer.algorithm.reward = recording
    try:
        history = [m for m in trainer.fit() if m.get("training/global_step", 0) >= 1]
    finally:
        trainer.close()
    assert len(history) == 4 and len(rows) == 4
    for step, (r, m) in enumerate(zip(rows, history), start=1):
        per_token, version = r["rollout_policy_version"], r["policy_version"]
        assert bool((per_token[:, 1:] >= per_token[:, :-1]).all()), f"step {step}: a version went back in a row"
        assert torch.equal(version, per_token.min(1).values), f"step {step}"
        assert int((step - 1) - version.min()) <= 1 and m["staleness/max"] <= 1, f"step {step}"
        mixed = float((per_token.max(1).values != per_token.min(1).values).double().mean())
        assert m["async/mixed_version_rows"] == mixed, f"step {step}"


def test_async_resume_on_ray_keeps_the_rollouts_generated_before_a_stop(tmp_path: Path) -> None:
    """A stop during step 2 saves the queue (batch 3, generated with version 1 on the rollout actor) through Ray into
    rank 0's checkpoint; the resumed run trains it with its version, then every other prompt of the epoch once."""

    def fit(stop_after: int | None, rows: list[dict[str, Any]]) -> list[float]:
        cfg = tiny_ppo_config(tmp_path, tmp_path / "ckpt", 4, "trainer.backend=ray", "trainer.mode=async",
                              "trainer.async.max_staleness=1", "trainer.async.chunk_prompts=1",
                              "data.train_batch_size=4", "trainer.total_training_steps=4", "trainer.logger=[]",
                              f"trainer.run_dir={tmp_path}/run", "trainer.resume_mode=auto",
                              "trainer.checkpoint.save_freq=100")
        trainer = PPOTrainer(cfg)
        step = trainer.algorithm.step

        def stepping(batch: Any, n: int) -> dict[str, float]:
            rows.append({"step": n, "version": batch.batch["policy_version"].clone(),
                         "uid": set(batch.non_tensor_batch["uid"])})
            out = step(batch, n)
            if n == stop_after:
                trainer.stop.request(signal.SIGTERM)
            return out

        trainer.algorithm.step = stepping
        try:
            trainer.fit()
        except KeyboardInterrupt:  # `Interrupted`, after the stop's checkpoint
            assert stop_after is not None
        finally:
            trainer.close()
        return [m["training/global_step"] for m in trainer.history if m.get("training/global_step", 0) >= 1]

    rows: list[dict[str, Any]] = []
    assert fit(2, rows) == [1, 2]
    assert fit(None, rows) == [3, 4]
    assert (tmp_path / "ckpt" / "global_step_2" / "driver").is_dir()
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert int(rows[2]["version"].min()) == 1  # generated before the stop, kept (a regenerated batch: version 2)
    for r in rows:
        assert int(((r["step"] - 1) - r["version"]).max()) <= 1, r["step"]
    assert len(set().union(*(r["uid"] for r in rows))) == 16 and sum(len(r["uid"]) for r in rows) == 16
