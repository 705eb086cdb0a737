"""trainer.mode one_step_off / async on the local backend: bit-exact weight sync, one_step_off equals
sync at a zero-effect learning rate, staleness accounting and its bound, resume, config errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ppo_testlib import SimulatedCrash, tiny_ppo_config

from hybridflow.config import ConfigError
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.workers.weight_sync import load_buckets, pack_buckets

STEPS = 3


def _cfg(tmp: Path, mode: str, *extra: str):
    tmp.mkdir(parents=True, exist_ok=True)
    return tiny_ppo_config(tmp, tmp / "ckpt", 2, f"trainer.mode={mode}", f"trainer.total_training_steps={STEPS}",
                           "trainer.resume_mode=disable", "trainer.logger=[]", f"trainer.run_dir={tmp}/run", *extra)


def _fit(cfg, record: list[dict[str, Any]] | None = None, after: Any = None,
         crash_at: int | None = None) -> list[dict[str, float]]:
    """Run `cfg`; `record` gets each step's generated rows (responses, rollout log-probs, versions, uids);
    `crash_at`: raise `SimulatedCrash` when that step starts (after the batches ahead of it were generated)."""
    trainer = PPOTrainer(cfg)
    alg = trainer.algorithm
    if crash_at is not None:
        step = alg.step

        def crashing(batch, n):
            if n == crash_at:
                raise SimulatedCrash(f"step {n}")
            return step(batch, n)

        alg.step = crashing
    if record is not None:
        reward = alg.reward

        def recording(batch, metrics):
            b = batch.batch
            record.append({"responses": b["responses"].clone(), "log_probs": b["rollout_log_probs"].clone(),
                           "version": b.get("policy_version"), "uid": list(batch.non_tensor_batch["uid"])})
            return reward(batch, metrics)

        alg.reward = recording
    try:
        history = trainer.fit()
        if after is not None:
            after(trainer)
    finally:
        trainer.close()
    return [m for m in history if m.get("training/global_step", 0) >= 1]


def _actor_weights(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    buckets = trainer.actor.weight_buckets(1 << 30)[0]
    return {name: t.clone() for b in buckets for name, t in b.tensors()}


# ------------------------------------------------------------------------------------------------- weight sync
def test_buckets_round_trip_bit_exact_and_split_by_size_and_dtype() -> None:
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    src[1].bias.data = src[1].bias.data.to(torch.float64)  # a dtype change starts a new bucket
    dst = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    dst[1].bias.data = dst[1].bias.data.to(torch.float64)
    buckets = pack_buckets([(n, p.detach()) for n, p in src.named_parameters()], bucket_bytes=16 * 8 * 4)
    assert [b.names for b in buckets] == [["0.weight"], ["0.bias", "1.weight"], ["1.bias"]]
    assert load_buckets(dst, buckets) == sum(p.numel() * p.element_size() for p in src.parameters())
    for (name, a), b in zip(src.named_parameters(), dst.parameters()):
        assert torch.equal(a, b) and a.dtype == b.dtype, name
    with pytest.raises(KeyError, match="no value for"):
        load_buckets(torch.nn.Sequential(*dst, torch.nn.Linear(4, 1)), buckets)  # "2.*" gets nothing


def test_rollout_weights_equal_trainer_weights_after_updates(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    def check(trainer: PPOTrainer) -> None:
        actor = _actor_weights(trainer)
        rollout = trainer.groups.rollout.weights()[0]
        assert rollout.keys() == actor.keys()
        for name, t in actor.items():
            assert torch.equal(rollout[name], t), f"{name}: rollout copy differs from the trainer's"
        seen["version"] = trainer.groups.rollout.policy_version()[0]

    history = _fit(_cfg(tmp_path, "one_step_off", "trainer.weight_sync.bucket_mb=0.05"), after=check)
    assert seen["version"] == STEPS  # the last update's weights were sent after step 3
    for m in history:
        assert m["weight_sync/buckets"] > 1 and m["weight_sync/bytes"] > 0 and m["timing/weight_sync"] >= 0
        assert m["weight_sync/collective"] == 0.0  # transport auto on the local backend: the buckets in the call
    assert any(m["actor/pg_loss"] != 0 for m in history)  # the weights did move (so equality means something)


# ---------------------------------------------------------------------------------------------- one_step_off
def test_one_step_off_matches_sync_at_zero_effect_learning_rate(tmp_path: Path) -> None:
    # optim.lr must be > 0; at 1e-30 an fp32 Adam step leaves every non-zero weight bit-identical and moves the
    # zero-initialised biases by ~1e-30 (asserted below), far under any activation's rounding: the policy does not
    # change, so both modes must draw the same samples from the same seeds
    lr = "actor.optim.lr=1e-30"
    runs: dict[str, list[dict[str, Any]]] = {}
    weights: dict[str, dict[str, torch.Tensor]] = {}
    for mode in ("sync", "one_step_off"):
        runs[mode] = []
        _fit(_cfg(tmp_path / mode, mode, lr), record=runs[mode],
             after=lambda tr, m=mode: weights.__setitem__(m, _actor_weights(tr)))
    initial = _actor_weights_of_fresh(tmp_path)
    for name, t in weights["one_step_off"].items():
        assert float((t - initial[name]).abs().max()) < 1e-28, f"{name} moved at lr 1e-30: the premise fails"
    assert len(runs["sync"]) == len(runs["one_step_off"]) == STEPS
    for step, (a, b) in enumerate(zip(runs["sync"], runs["one_step_off"]), start=1):
        assert a["uid"] == b["uid"], f"step {step}: different prompts"
        assert torch.equal(a["responses"], b["responses"]), f"step {step}: different samples"
        torch.testing.assert_close(a["log_probs"], b["log_probs"], rtol=0, atol=1e-6)
        assert a["version"] is None and b["version"].tolist() == [max(0, step - 2)] * len(b["version"])


def _actor_weights_of_fresh(tmp_path: Path) -> dict[str, torch.Tensor]:
    from hybridflow.config import resolve
    from hybridflow.trainer.roles import build_worker_groups

    cfg = _cfg(tmp_path / "fresh", "sync")
    groups = build_worker_groups(cfg, resolve(cfg), STEPS)
    try:
        buckets = groups.actor.weight_buckets(1 << 30)[0]
        return {name: t.clone() for b in buckets for name, t in b.tensors()}
    finally:
        groups.close()


def test_one_step_off_staleness_and_versions(tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = []
    history = _fit(_cfg(tmp_path, "one_step_off", "trainer.total_training_steps=4"), record=rows)
    assert [m["staleness/max"] for m in history] == [0.0, 1.0, 1.0, 1.0]
    assert [m["staleness/mean"] for m in history] == [0.0, 1.0, 1.0, 1.0]
    assert [int(r["version"].max()) for r in rows] == [0, 0, 1, 2]  # batch k+1 was generated before step k trained
    for m in history:
        assert {"timing/wait_rollout", "timing/wait_train", "timing/weight_sync"} <= m.keys()


# ------------------------------------------------------------------------------------------------------ async
@pytest.mark.parametrize("max_staleness", [0, 2])
def test_async_staleness_never_exceeds_its_bound(tmp_path: Path, max_staleness: int) -> None:
    rows: list[dict[str, Any]] = []
    history = _fit(_cfg(tmp_path, "async", "trainer.total_training_steps=4", "data.train_batch_size=4",
                        "actor.ppo_mini_batch_size=4", f"trainer.async.max_staleness={max_staleness}",
                        "trainer.async.chunk_prompts=1"), record=rows)
    assert len(history) == 4  # 16 prompts, 4 per step
    for step, (m, r) in enumerate(zip(history, rows), start=1):
        staleness = (step - 1) - r["version"]
        assert int(staleness.max()) <= max_staleness, f"step {step}: staleness {staleness.tolist()}"
        assert m["staleness/max"] == float(staleness.max())
        assert m["async/requests"] == 4  # 4 one-prompt requests per batch of 4 prompts
    # the bound is reached, not merely respected: from step max_staleness + 1 on the queue runs that far ahead
    assert [m["staleness/max"] for m in history] == [float(min(s, max_staleness)) for s in range(4)]
    uids = [u for r in rows for u in r["uid"]]
    assert len(set(uids)) == len(uids) // 4  # every prompt trained once (4 samples each), none lost or repeated


AGENT = """
async def run(client, sample):
    await client.chat.completions.create(model="policy", messages=list(sample["raw_prompt"]), max_tokens=4)
"""


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_agent_endpoint_in_pipelined_modes(tmp_path: Path, mode: str) -> None:
    """rollout.agent.mode=server on the rollout workers: weights change between generate calls, and every sampled
    token records the version it was served with (async: partial_rollout=abort, the default)."""
    (tmp_path / "agent.py").write_text(AGENT)
    cfg = _cfg(tmp_path, mode, "rollout.agent.mode=server", f"rollout.agent.path={tmp_path / 'agent.py'}")
    rows: list[dict[str, Any]] = []
    history = _fit(cfg, record=rows)
    # agent/tasks: 8 per batch in one_step_off; async generates a batch in requests of 1 prompt x 4 samples
    assert len(history) == STEPS and all(m["agent/tasks"] >= 4 and m["agent/errors"] == 0 for m in history), history
    versions = [int(r["version"].max()) for r in rows]
    if mode == "one_step_off":
        assert versions == [0, 0, 1]
    else:
        assert all(0 <= (step - 1) - v <= cfg.trainer.async_.max_staleness for step, v in enumerate(versions, 1))


def test_async_aborts_and_resubmits_requests_that_would_break_the_bound(tmp_path: Path) -> None:
    # The driver never queues more than (max_staleness + 1) batches, so no request is too old when consumed; here
    # the queue is made one batch deeper than that, so the oldest requests would break the bound: they must be
    # dropped and their prompts generated again with the newest weights (trainer.async.partial_rollout=abort).
    rows: list[dict[str, Any]] = []
    cfg = _cfg(tmp_path, "async", "trainer.total_training_steps=4", "data.train_batch_size=4",
               "actor.ppo_mini_batch_size=4", "trainer.async.max_staleness=0", "trainer.async.chunk_prompts=1")
    trainer = PPOTrainer(cfg)
    trainer.algorithm.driver.capacity = 2 * 4
    reward = trainer.algorithm.reward
    trainer.algorithm.reward = lambda b, m: (rows.append({"version": b.batch["policy_version"].clone(),
                                                           "uid": list(b.non_tensor_batch["uid"])}), reward(b, m))[1]
    try:
        history = [m for m in trainer.fit() if m.get("training/global_step", 0) >= 1]
    finally:
        trainer.close()
    assert [m["staleness/max"] for m in history] == [0.0] * 4
    for step, r in enumerate(rows, start=1):
        assert r["version"].tolist() == [step - 1] * 16, f"step {step}: trained rows of versions {r['version']}"
    assert history[-1]["async/aborted_prompts"] > 0
    uids = [u for r in rows for u in r["uid"]]
    assert len(set(uids)) == len(uids) // 4  # an aborted prompt is trained once, after its resubmission


# ------------------------------------------------------------------------------------------------------ resume
@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_resume_continues_with_the_untrained_prompts(tmp_path: Path, mode: str) -> None:
    extra = ("trainer.resume_mode=auto", "trainer.checkpoint.save_freq=1", "trainer.checkpoint.async_save=false")
    whole: list[dict[str, Any]] = []
    _fit(_cfg(tmp_path / "whole", mode, *extra, "trainer.total_training_steps=4"), record=whole)
    first: list[dict[str, Any]] = []
    with pytest.raises(SimulatedCrash):  # dies at step 3, after step 2's checkpoint; batch 4 was already pulled
        _fit(_cfg(tmp_path / "split", mode, *extra, "trainer.total_training_steps=4"), record=first, crash_at=3)
    assert len(first) == 2
    rest: list[dict[str, Any]] = []
    history = _fit(_cfg(tmp_path / "split", mode, *extra, "trainer.total_training_steps=4"), record=rest)
    assert [m["training/global_step"] for m in history] == [3.0, 4.0]
    # the prompts generated ahead (steps 3, 4) before the crash were not trained: the resumed run trains them
    assert [r["uid"] for r in first + rest] == [r["uid"] for r in whole]
    # step 3's batch was generated before step 2's save (version 1, as in the uninterrupted run) and kept in it
    assert [r["version"].tolist() for r in first + rest] == [r["version"].tolist() for r in whole]
    assert history[0]["staleness/max"] == 1.0 and int(rest[0]["version"].min()) == 1


# ------------------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize(("override", "message"), [
    ("trainer.mode=fast", "trainer.mode='fast': must be one of 'sync', 'one_step_off', 'async'"),
    ("trainer.async.partial_rollout=resume", "trainer.async.partial_rollout='resume': must be one of 'abort', "
                                             "'continue'"),
    ("trainer.async.max_staleness=-1", "trainer.async.max_staleness"),
    ("trainer.weight_sync.transport=nccl", "trainer.weight_sync.transport='nccl': must be one of 'auto', "
                                           "'collective', 'call'"),
    ("trainer.weight_sync.timeout_s=0", "trainer.weight_sync.timeout_s"),
    ("trainer.backend=local trainer.weight_sync.transport=collective",
     "trainer.weight_sync.transport=collective with trainer.backend=local"),
])
def test_config_errors(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _cfg(tmp_path, "async", *override.split())


def test_collective_transport_needs_ray_workers(tmp_path: Path) -> None:
    """backend=auto with one process each runs both groups on the local backend: nobody to broadcast to."""
    with pytest.raises(ValueError, match="trainer.weight_sync.transport=collective needs the actor and the rollout "
                                         "workers on Ray"):
        PPOTrainer(_cfg(tmp_path, "one_step_off", "trainer.backend=auto", "trainer.weight_sync.transport=collective"))


def test_unsupported_combinations_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="trainer.async.chunk_prompts=3 must divide data.train_batch_size=2"):
        _cfg(tmp_path, "async", "trainer.async.chunk_prompts=3")
    with pytest.raises(ConfigError, match="trainer.async.partial_rollout=continue applies to trainer.mode=async"):
        _cfg(tmp_path, "one_step_off", "trainer.async.partial_rollout=continue")
