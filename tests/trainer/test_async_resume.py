"""Resume of trainer.mode one_step_off / async keeps the pipeline (local backend, tiny CPU model): the rollouts
generated ahead are saved in the checkpoint with their versions and prompts, so N steps straight equal k steps +
save + resume + N-k steps bit for bit (weights and every per-step metric but wall-clock ones), and no prompt is
lost or trained twice across a stop."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from ppo_testlib import SimulatedCrash, deterministic_metrics, tiny_ppo_config

from hybridflow.checkpoint.storage import read_flat_tensors
from hybridflow.data.dataloader import DataPosition
from hybridflow.protocol import DataProto
from hybridflow.trainer.async_driver import OneStepOffDriver
from hybridflow.trainer.async_resume import Pipeline, SavedRequest, from_payload, to_payload
from hybridflow.trainer.ppo import PPOTrainer
from hybridflow.trainer.stop import Interrupted

PER_RUN = ("data/skipped_rows", "weight_sync/rollout_")  # once per run; the rollout side's seconds


def _cfg(tmp: Path, mode: str, *extra: str):
    tmp.mkdir(parents=True, exist_ok=True)
    return tiny_ppo_config(tmp, tmp / "ckpt", 2, f"trainer.mode={mode}", "trainer.resume_mode=auto",
                           "trainer.checkpoint.async_save=false", "trainer.logger=[]", f"trainer.run_dir={tmp}/run",
                           *extra)


def _fit(cfg, rows: list[dict[str, Any]], crash_at: int | None = None, stop_after: int | None = None,
         capacity: int | None = None) -> list[dict[str, float]]:
    """Train; `rows` gets each step's trained rows. `crash_at`: die as that step starts; `stop_after`: a SIGTERM
    arrives during that step (the loop saves it and stops); `capacity`: the async queue's depth in prompts."""
    trainer = PPOTrainer(cfg)
    alg = trainer.algorithm
    if capacity is not None:
        alg.driver.capacity = capacity
    step = alg.step

    def stepping(batch, n):
        b, uids = batch.batch, list(batch.non_tensor_batch["uid"])
        if n == crash_at:
            rows.append({"step": n, "crashed": True, "uid": uids})
            raise SimulatedCrash(f"step {n}")
        if "responses" not in b:  # sync mode: the step generates
            rows.append({"step": n, "uid": uids})
        else:
            rows.append({"step": n, "responses": b["responses"].clone(), "log_probs": b["rollout_log_probs"].clone(),
                         "version": b["policy_version"].clone(), "uid": uids})
        out = step(batch, n)
        if n == stop_after:
            trainer.stop.request(signal.SIGTERM)
        return out

    alg.step = stepping
    try:
        trainer.fit()
    except SimulatedCrash:
        assert crash_at is not None
    except Interrupted:
        assert stop_after is not None
    finally:
        trainer.close()
    return [m for m in trainer.history if m.get("training/global_step", 0) >= 1]


def _same(m: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in deterministic_metrics(m).items() if not k.startswith(PER_RUN)}


def _actor(ckpt: Path) -> dict[str, torch.Tensor]:
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    return read_flat_tensors(ckpt / "actor", meta["components"]["actor"]["format"], "")


def _assert_equal_runs(straight: list[dict[str, float]], split: list[dict[str, float]],
                       rows_a: list[dict[str, Any]], rows_b: list[dict[str, Any]]) -> None:
    assert [m["training/global_step"] for m in split] == [m["training/global_step"] for m in straight]
    for a, b in zip(straight, split):
        assert _same(a) == _same(b), a["training/global_step"]
    assert len(rows_a) == len(rows_b)
    for a, b in zip(rows_a, rows_b):
        assert a["uid"] == b["uid"] and torch.equal(a["version"], b["version"]), a["step"]
        assert torch.equal(a["responses"], b["responses"]) and torch.equal(a["log_probs"], b["log_probs"]), a["step"]


def test_one_step_off_resume_is_bit_exact(tmp_path: Path) -> None:
    common = ("trainer.total_training_steps=5", "trainer.checkpoint.save_freq=2")
    rows_a: list[dict[str, Any]] = []
    straight = _fit(_cfg(tmp_path / "a", "one_step_off", *common), rows_a)
    rows_b: list[dict[str, Any]] = []
    first = _fit(_cfg(tmp_path / "b", "one_step_off", *common), rows_b, crash_at=3)  # after step 2's save
    assert rows_b.pop()["crashed"]
    rest = _fit(_cfg(tmp_path / "b", "one_step_off", *common), rows_b)
    assert [m["training/global_step"] for m in rest] == [3, 4, 5]
    _assert_equal_runs(straight, first + rest, rows_a, rows_b)
    assert (tmp_path / "b" / "ckpt" / "global_step_2" / "driver").is_dir()  # batch 3, generated with version 1
    assert rest[0]["staleness/max"] == 1.0 and int(rows_b[2]["version"].max()) == 1  # kept, not regenerated
    assert straight[2]["actor/pg_loss"] != straight[3]["actor/pg_loss"]  # the run really trains
    a, b = _actor(tmp_path / "a" / "ckpt" / "global_step_5"), _actor(tmp_path / "b" / "ckpt" / "global_step_5")
    assert a.keys() == b.keys() and any(k.startswith("optimizer") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(("max_staleness", "capacity"), [(1, None), (0, 8)])
def test_async_resume_after_a_stop_trains_every_prompt_once(tmp_path: Path, max_staleness: int,
                                                            capacity: int | None) -> None:
    # 16 prompts, 4 per step: 6 steps are 1.5 epochs; stopped during step 3, batch 4 (and, with the bound 1, the
    # queue run ahead of it) was generated before the stop. (0, 8): a queue one batch deeper than the bound allows,
    # so requests are dropped for staleness and resubmitted — the checkpoint also holds prompts not yet resubmitted.
    common = ("trainer.total_training_steps=6", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
              f"trainer.async.max_staleness={max_staleness}", "trainer.async.chunk_prompts=1",
              "trainer.checkpoint.save_freq=100")
    rows_a: list[dict[str, Any]] = []
    straight = _fit(_cfg(tmp_path / "a", "async", *common), rows_a, capacity=capacity)
    rows_b: list[dict[str, Any]] = []
    first = _fit(_cfg(tmp_path / "b", "async", *common), rows_b, stop_after=3, capacity=capacity)
    assert [m["training/global_step"] for m in first] == [1, 2, 3]
    rest = _fit(_cfg(tmp_path / "b", "async", *common), rows_b, capacity=capacity)
    assert [m["training/global_step"] for m in rest] == [4, 5, 6]

    epoch = [u for r in rows_b[:4] for u in r["uid"]]  # every prompt of the interrupted epoch trained once
    assert len(epoch) == 16 * 4 and len(set(epoch)) == 16 and all(epoch.count(u) == 4 for u in set(epoch))
    for r in rows_b:
        assert int(((r["step"] - 1) - r["version"]).max()) <= max_staleness, r["step"]
    _assert_equal_runs(straight, first + rest, rows_a, rows_b)
    assert (tmp_path / "b" / "ckpt" / "global_step_3" / "driver").is_dir()  # the queue at the stop
    if max_staleness == 1:
        assert int(rows_b[3]["version"].min()) == 2  # step 4's batch was generated before the stop, and kept
    if capacity is not None:
        assert rest[-1]["async/aborted_prompts"] > 0


def test_a_checkpoint_resumed_in_sync_mode_generates_the_saved_prompts_again(tmp_path: Path) -> None:
    common = ("trainer.total_training_steps=4", "trainer.checkpoint.save_freq=2")
    rows: list[dict[str, Any]] = []
    _fit(_cfg(tmp_path, "one_step_off", *common), rows, crash_at=3)
    crashed = rows.pop()
    rest = _fit(_cfg(tmp_path, "sync", *common), rows)
    assert [m["training/global_step"] for m in rest] == [3, 4]
    assert "responses" not in rows[2] and set(rows[2]["uid"]) == set(crashed["uid"])  # batch 3, generated again
    per_step = [set(r["uid"]) for r in rows]
    assert len(per_step) == 4 and len(set().union(*per_step)) == 4 * 2  # 2 prompts a step, none twice


def _prompts(*uids: str) -> DataProto:
    return DataProto.from_dict({"input_ids": torch.arange(len(uids)).view(-1, 1)}, {"uid": list(uids)})


def _driver(payload: dict[str, Any]) -> OneStepOffDriver:
    d = object.__new__(OneStepOffDriver)  # only the resume bookkeeping, no worker groups
    d.mode, d._sources, d._next_source, d._trained_source, d.trained_position = "one_step_off", {}, 0, -1, None
    d.load_checkpoint_payload(payload)
    return d


def test_restore_skips_the_batches_it_holds_unless_the_data_changed() -> None:
    held = _prompts("p2", "p3")
    pipe = Pipeline("one_step_off", [SavedRequest(held, {"rollout/x": 1.0}, held, 0, 2, 1)],
                    sources={1: (DataPosition(0, 2), 1)}, next_source=2, trained_source=0,
                    trained_position=DataPosition(0, 1))
    payload = to_payload(pipe)
    assert from_payload(payload, "async") is None  # another mode's pipeline: its prompts are generated again

    d = _driver(payload)
    it, got = d._restore(iter([_prompts("p2", "p3"), _prompts("p4", "p5")]))
    assert got is not None and got.requests[0].metrics == {"rollout/x": 1.0} and got.requests[0].planned_step == 2
    assert list(next(it).non_tensor_batch["uid"]) == ["p4", "p5"]  # the held batch was skipped
    assert (d._next_source, d._trained_source, d.trained_position) == (2, 0, DataPosition(0, 1))
    assert d._sources[1].chunks_left == 1

    d = _driver(payload)
    it, got = d._restore(iter([_prompts("q2", "q3"), _prompts("q4", "q5")]))  # other data now: nothing skipped
    assert got is None and d._next_source == 0
    assert [list(b.non_tensor_batch["uid"]) for b in it] == [["q2", "q3"], ["q4", "q5"]]
