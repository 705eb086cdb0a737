"""`run_stages` with fake stages (no model): the order each stage runs in, what each sees, and that held host work
reaches a worker call as its argument."""

from __future__ import annotations

import threading

import pytest
import torch

from hybridflow.protocol import DataProto, keys
from hybridflow.trainer.stage_schedule import Stage, WorkerCall, plan_overlap, run_stages
from hybridflow.trainer.timing import StageTimer

MAIN = threading.main_thread().name


def _stages(events: list[str], *, late: bool = True, call_back: bool = True) -> list[Stage | WorkerCall]:
    """gen, reward (overlaps), balance, old_log_prob, ref, adv, update_actor: each records its name (and thread)."""
    def host(name: str, column: str | None):
        def run(batch: DataProto, metrics: dict[str, float]) -> DataProto:
            events.append(f"{name}:{threading.current_thread().name}")
            if column is not None:
                batch.batch[column] = torch.full((len(batch),), float(len(events)))
            metrics[f"{name}/ran"] = 1.0
            return batch
        return run

    def call(name: str, column: str | None):
        def run(batch: DataProto, metrics: dict[str, float], beside=None) -> DataProto | None:
            events.append(f"{name}:queued:{threading.current_thread().name}:sees={sorted(batch.batch)}")
            got = beside() if beside is not None and call_back else None
            events.append(f"{name}:done" + (f":late={sorted(got.batch)}" if got is not None else ""))
            return None if column is None else DataProto.from_dict({column: torch.zeros(len(batch))})
        return run

    return [Stage("gen", host("gen", "responses")),
            Stage("reward", host("reward", "token_level_scores"), keys.REWARD, overlaps=True),
            Stage("balance", host("balance", None), timed=False),
            WorkerCall("old_log_prob", call("old_log_prob", "old_log_probs"), keys.OLD_LOG_PROB),
            WorkerCall("ref", call("ref", "ref_log_prob"), keys.REF),
            Stage("adv", host("adv", "advantages"), keys.ADV),
            WorkerCall("update_actor", call("update_actor", None), keys.UPDATE_ACTOR, late=late)]


def _batch() -> DataProto:
    return DataProto.from_dict({"input_ids": torch.zeros(4, 3, dtype=torch.long)})


def _run(stages, in_process: bool) -> tuple[DataProto, dict[str, float], StageTimer]:
    timer, metrics = StageTimer(sync_cuda=False), {}
    return run_stages(stages, _batch(), timer, metrics, in_process), metrics, timer


def test_in_order_without_an_overlapping_stage():
    events: list[str] = []
    stages = [s if s.name != "reward" else Stage("reward", s.run, keys.REWARD) for s in _stages(events)]
    batch, metrics, timer = _run(stages, in_process=True)
    first = ["input_ids", "responses", "token_level_scores"]
    assert [e.split(":")[0] for e in events] == ["gen", "reward", "balance", "old_log_prob", "old_log_prob", "ref",
                                                 "ref", "adv", "update_actor", "update_actor"]
    assert f"ref:queued:{MAIN}:sees={first}" in events  # one batch for the calls in a row, columns after both
    assert sorted(batch.batch) == sorted([*first, "old_log_probs", "ref_log_prob", "advantages"])
    assert set(timer.times) == {"gen", "reward", "old_log_prob", "ref", "adv", "update_actor"}
    assert metrics == {f"{n}/ran": 1.0 for n in ("gen", "reward", "balance", "adv")}


def test_the_reward_runs_inside_the_first_call_in_process():
    events: list[str] = []
    batch, metrics, timer = _run(_stages(events), in_process=True)
    assert events == [f"gen:{MAIN}", f"balance:{MAIN}",
                      f"old_log_prob:queued:{MAIN}:sees=['input_ids', 'responses']", f"reward:{MAIN}",
                      "old_log_prob:done:late=['input_ids', 'responses', 'token_level_scores']",
                      f"ref:queued:{MAIN}:sees=['input_ids', 'responses']", "ref:done",
                      f"adv:{MAIN}", events[-2], "update_actor:done"]
    assert "token_level_scores" in events[-2]  # after both calls: the advantages see the scores
    assert sorted(batch.batch) == ["advantages", "input_ids", "old_log_probs", "ref_log_prob", "responses",
                                   "token_level_scores"]
    assert "reward/ran" in metrics and "reward" in timer.times


def test_the_calls_run_on_a_thread_out_of_process():
    events: list[str] = []
    batch, _, _ = _run(_stages(events), in_process=False)
    queued = [e for e in events if ":queued:" in e][:2]
    assert all(":worker-stages" in e for e in queued), queued
    assert f"reward:{MAIN}" in events and "token_level_scores" in batch.batch


def test_the_update_takes_the_reward_and_advantages_as_late_columns():
    events: list[str] = []
    stages = [s for s in _stages(events) if s.name not in ("old_log_prob", "ref")]
    plan = plan_overlap(stages, in_process=True)
    assert plan is not None and plan.late and [s.name for s in plan.held] == ["reward", "adv"]
    batch, _, _ = _run(stages, in_process=True)
    assert events[2:] == [f"update_actor:queued:{MAIN}:sees=['input_ids', 'responses']", f"reward:{MAIN}",
                          f"adv:{MAIN}", "update_actor:done:late=['advantages', 'input_ids', 'responses', "
                          "'token_level_scores']"]
    assert "advantages" in batch.batch
    assert plan_overlap(stages, in_process=False) is None  # columns arrive by callback only
    assert plan_overlap([s for s in _stages([], late=False) if s.name not in ("old_log_prob", "ref")], True) is None


def test_a_call_that_never_ran_the_held_work_is_refused():
    with pytest.raises(RuntimeError, match="old_log_prob call returned without running reward"):
        _run(_stages([], call_back=False), in_process=True)


def test_the_held_works_error_is_the_one_raised():
    def broken(batch: DataProto, metrics: dict[str, float]) -> DataProto:
        raise ValueError("reward broke on row 2")

    def wrapping(batch: DataProto, metrics: dict[str, float], beside=None) -> DataProto | None:
        if beside is None:  # out of process: the call runs on a thread, the reward here
            return None
        try:
            beside()
        except ValueError as err:  # a worker call reports the failure as its own error
            raise RuntimeError("worker call failed") from err
        raise AssertionError("unreachable")

    stages = [Stage("reward", broken, keys.REWARD, overlaps=True),
              WorkerCall("old_log_prob", wrapping, keys.OLD_LOG_PROB)]
    for in_process in (True, False):
        with pytest.raises(ValueError, match="broke on row 2"):
            _run(stages, in_process)
