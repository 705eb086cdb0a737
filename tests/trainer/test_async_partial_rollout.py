"""trainer.async.partial_rollout=continue: the rollout worker takes weights sent while a generate call runs
at its next decode-chunk boundary; every token keeps the version that sampled it; the driver's staleness accounting
and bound use each row's oldest token. Local backend (the Ray path: test_async_ray.py; the engine side: tests/rollout/test_rollout_token_versions.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ppo_testlib import tiny_ppo_config

from hybridflow.config import ConfigError
from hybridflow.protocol import DataProto
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.trainer.roles import build_rollout_group
from hybridflow.workers.weight_sync import full_parameters, pack_buckets

CONTINUE = "trainer.async.partial_rollout=continue"


def _cfg(tmp: Path, *extra: str):
    tmp.mkdir(parents=True, exist_ok=True)
    return tiny_ppo_config(tmp, tmp / "ckpt", 4, "trainer.mode=async", "trainer.total_training_steps=4",
                           "data.train_batch_size=4", "trainer.async.chunk_prompts=1", "trainer.resume_mode=disable",
                           "trainer.logger=[]", f"trainer.run_dir={tmp}/run", *extra)


def _prompts(vocab: int, B: int = 3, P: int = 6) -> DataProto:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    return DataProto.from_single_dict({"input_ids": ids, "attention_mask": mask,
                                       "position_ids": torch.arange(P).expand(B, P).clone(),
                                       "seeds": torch.tensor([5, 6, 7])})


def _wait(cond, what: str, timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def test_weights_sent_mid_generation_apply_at_the_next_chunk(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, CONTINUE, "data.max_response_length=12")
    group, pool = build_rollout_group(cfg)
    try:
        worker = group.worker_group._handles[0].worker  # noqa: SLF001 - the in-process worker (local backend)
        vocab = worker.module.config.vocab_size
        new = {n: (torch.zeros_like(t) if n == "lm_head.weight" else t) for n, t in full_parameters(worker.module)}
        buckets = pack_buckets(new.items(), 1 << 30)
        checks = [0]
        real = worker._take_inbox

        def check() -> int:  # the worker's weight check between decode chunks, observed
            checks[0] += 1
            if checks[0] == 3:  # hold the third check until the weights are in the inbox: the swap lands here
                _wait(lambda: worker._inbox is not None, "the weights to arrive")
            return real()

        worker._take_inbox = check
        result: list[DataProto] = []
        gen = threading.Thread(target=lambda: result.append(worker.generate_sequences(_prompts(vocab))))
        gen.start()
        _wait(lambda: checks[0] >= 2, "generation to start")
        metrics = worker.receive_weights_live(buckets, 1)  # returns once the generate call installed them
        gen.join(60)
        assert not gen.is_alive()
        out = result[0]
        assert metrics["weight_sync/version"] == 1 and worker.version == 1
        # checks: 1 = start, 2 = after decode step 1, 3 = after step 2: rows still decoding switch at token 3
        lengths = out.batch["response_mask"].sum(-1)
        assert int((lengths > 3).sum()) >= 1, "every row ended before the swap: the test is void"
        t = torch.arange(out.batch["responses"].shape[1])[None]
        expected = ((t >= 3) & (lengths[:, None] > 3)).long()
        versions = out.batch["rollout_policy_version"]
        assert torch.equal(versions, expected), versions
        assert torch.equal(out.batch["policy_version"], versions.min(1).values)  # a row's = its oldest token's
        assert out.meta_info["metrics"]["rollout/weight_swaps"] == 1
        logp = out.batch["rollout_log_probs"][(versions == 1) & out.batch["response_mask"].bool()]
        torch.testing.assert_close(logp, torch.full_like(logp, -float(torch.log(torch.tensor(float(vocab))))))
        # with no generate call running, weights are installed at once
        worker._take_inbox = real
        metrics = worker.receive_weights_live(pack_buckets(full_parameters(worker.module), 1 << 30), 2)
        assert worker.version == 2 and worker._inbox is None
    finally:
        group.worker_group.shutdown()
        pool.release()


def test_a_failed_install_mid_generation_wakes_and_fails_the_sender(tmp_path: Path) -> None:
    """Weights that do not fit the model, sent while a generate call runs: the generate call raises, the waiting
    `receive_weights_live` raises too (naming the version) instead of waiting forever, and the next generate runs."""
    cfg = _cfg(tmp_path, CONTINUE, "data.max_response_length=12")
    group, pool = build_rollout_group(cfg)
    try:
        worker = group.worker_group._handles[0].worker  # noqa: SLF001 - the in-process worker (local backend)
        vocab = worker.module.config.vocab_size
        bad = pack_buckets([("lm_head.weight", torch.zeros(3, 3))], 1 << 30)  # the wrong shape
        checks = [0]
        real = worker._take_inbox

        def check() -> int:
            checks[0] += 1
            if checks[0] == 3:
                _wait(lambda: worker._inbox is not None, "the weights to arrive")
            return real()

        worker._take_inbox = check
        errors: list[BaseException] = []

        def generate() -> None:
            try:
                worker.generate_sequences(_prompts(vocab))
            except Exception as err:  # noqa: BLE001 - the test inspects it
                errors.append(err)

        gen = threading.Thread(target=generate)
        gen.start()
        _wait(lambda: checks[0] >= 2, "generation to start")
        with pytest.raises(RuntimeError, match="policy version 1 failed"):
            worker.receive_weights_live(bad, 1)
        gen.join(60)
        assert not gen.is_alive() and len(errors) == 1, errors
        assert worker._inbox is None and worker.version == 0
        worker._take_inbox = real
        out = worker.generate_sequences(_prompts(vocab))  # the bad weights are not tried again
        assert int(out.batch["policy_version"].max()) == 0
    finally:
        group.worker_group.shutdown()
        pool.release()


def _fit(cfg, rows: list[dict[str, Any]]) -> list[dict[str, float]]:
    trainer = PPOTrainer(cfg)
    reward = trainer.algorithm.reward

    def recording(batch, metrics):
        b = batch.batch
        rows.append({k: b[k].clone() for k in ("responses", "rollout_log_probs", "policy_version",
                                               "rollout_policy_version", "response_mask")}
                    | {"uid": list(batch.non_tensor_batch["uid"])})
        return reward(batch, metrics)

    trainer.algorithm.reward = recording
    try:
        return [m for m in trainer.fit() if m.get("training/global_step", 0) >= 1]
    finally:
        trainer.close()


def test_continue_trains_with_per_token_versions_and_equals_abort_without_swaps(tmp_path: Path) -> None:
    # the local backend runs each call to completion, so weights never reach a generate call in progress: continue
    # must then draw exactly abort's samples, train the same, and label every token
    runs: dict[str, tuple[list[dict[str, float]], list[dict[str, Any]]]] = {}
    for mode in ("abort", "continue"):
        rows: list[dict[str, Any]] = []
        runs[mode] = (_fit(_cfg(tmp_path / mode, f"trainer.async.partial_rollout={mode}",
                                "trainer.async.max_staleness=1"), rows), rows)
    (h_abort, r_abort), (h_cont, r_cont) = runs["abort"], runs["continue"]
    assert len(h_cont) == 4
    for step, (a, c, m) in enumerate(zip(r_abort, r_cont, h_cont), start=1):
        assert a["uid"] == c["uid"] and torch.equal(a["responses"], c["responses"]), f"step {step}"
        assert torch.equal(a["rollout_log_probs"], c["rollout_log_probs"]), f"step {step}"
        per_token = c["rollout_policy_version"]
        assert torch.equal(c["policy_version"], per_token.min(1).values)
        assert torch.equal(per_token, c["policy_version"][:, None].expand_as(per_token))  # no swap, one version
        assert m["staleness/max"] <= 1 and m["staleness/token_mean"] == m["staleness/mean"]
        assert m["async/mixed_version_rows"] == 0.0
    assert [m["actor/pg_loss"] for m in h_abort] == [m["actor/pg_loss"] for m in h_cont]


def test_staleness_counts_the_oldest_token_and_drops_requests_past_the_bound(tmp_path: Path) -> None:
    """A request whose rows mix versions is as stale as its oldest token: made to arrive too stale (queue deeper
    than the bound), it is dropped and its prompts regenerated, as under abort."""
    rows: list[dict[str, Any]] = []
    cfg = _cfg(tmp_path, CONTINUE, "trainer.async.max_staleness=0")
    trainer = PPOTrainer(cfg)
    trainer.algorithm.driver.capacity = 2 * 4  # one batch deeper than max_staleness=0 allows
    reward = trainer.algorithm.reward
    trainer.algorithm.reward = lambda b, m: (rows.append({"v": b.batch["rollout_policy_version"].clone(),
                                                           "uid": list(b.non_tensor_batch["uid"])}), reward(b, m))[1]
    try:
        history = [m for m in trainer.fit() if m.get("training/global_step", 0) >= 1]
    finally:
        trainer.close()
    assert [m["staleness/max"] for m in history] == [0.0] * 4
    for step, r in enumerate(rows, start=1):
        assert bool((r["v"] == step - 1).all()), f"step {step}: trained tokens of versions {r['v'].unique()}"
    assert history[-1]["async/aborted_prompts"] > 0
    uids = [u for r in rows for u in r["uid"]]
    assert len(set(uids)) == len(uids) // 4


@pytest.mark.parametrize(("override", "message"), [
    ("trainer.mode=one_step_off", "trainer.async.partial_rollout=continue applies to trainer.mode=async"),
    ("trainer.async.weight_check_steps=0", "trainer.async.weight_check_steps"),
    ("rollout.agent.mode=server rollout.agent.path=agent.py",
     "partial_rollout=continue with rollout.agent.mode=server.*set trainer.async.partial_rollout=abort"),
])
def test_config_errors(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _cfg(tmp_path, CONTINUE, *override.split())
