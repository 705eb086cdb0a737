"""RewardManager: last-token placement, failure safety (raise / sleep / NaN / loop / dying worker) in the process
pool and in-process, mixing with precomputed reward-model scores, penalties, per-data-source metrics."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from hybridflow.config import load_config
from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rewards import RewardManager, select_reward_fn

TOK = builtin_tokenizer()
R = 16
BAD_FN = """
import math, os, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if "raise" in solution_str:
        raise RuntimeError("scorer bug")
    if "sleep" in solution_str:
        time.sleep(60)
    if "nan" in solution_str:
        return math.nan
    if "loop" in solution_str:
        while True:
            pass
    if "exit" in solution_str:
        os._exit(3)
    if "obj" in solution_str:
        return {"score": 0.5, "unpicklable": lambda: 0}
    if "text" in solution_str:
        return "not a number"
    return {"score": float(solution_str.strip() == ground_truth), "length": len(solution_str)}
"""


def _cfg(tmp_path, *overrides: str):
    path = tmp_path / "bad_reward.py"
    path.write_text(BAD_FN)
    return load_config([], [f"reward.custom.path={path}", "reward.timeout_s=0.5", "reward.error_score=-1.0",
                            *overrides]).reward


def _batch(texts, truths, data_sources=None, width=R, **tensors) -> DataProto:
    resp = torch.full((len(texts), width), TOK.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(resp)
    for i, text in enumerate(texts):
        ids = TOK(text, add_special_tokens=False)["input_ids"][:width]
        resp[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    n = len(texts)
    return DataProto.from_dict(
        {"responses": resp, "response_mask": mask, **tensors},
        {"data_source": data_sources or ["hybridflow/arithmetic"] * n,
         "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
         "extra_info": [{"index": i} for i in range(n)]})


@pytest.fixture(scope="module")
def pool_manager(tmp_path_factory):
    """One 2-process pool for the whole module (process start-up is the expensive part)."""
    cfg = _cfg(tmp_path_factory.mktemp("r"), "reward.num_workers=2",
               "reward.sources=[{name: custom, weight: 1.0}]")
    manager = RewardManager(cfg, TOK, R)
    yield manager
    manager.close()


FAILING = ["ok", "raise", "sleep", "nan", "loop", "ok2", "wrong", "obj", "text"]
TRUTHS = ["ok", "x", "x", "x", "x", "ok2", "right", "x", "x"]
EXPECTED = [1.0, -1.0, -1.0, -1.0, -1.0, 1.0, 0.0, 0.5, -1.0]


def test_pool_survives_raise_sleep_nan_loop(pool_manager, caplog):
    with caplog.at_level(logging.WARNING):
        out = pool_manager.score(_batch(FAILING, TRUTHS))
    assert out.scores.tolist() == EXPECTED
    assert out.metrics["reward/errors"] == 3 and out.metrics["reward/timeouts"] == 2
    assert "scorer bug" in caplog.text  # the first failure's traceback
    assert out.extras["custom/length"][0] == 2 and out.extras["custom/length"][1] is None
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        again = pool_manager.score(_batch(FAILING, TRUTHS))
    assert again.scores.tolist() == EXPECTED and "scorer bug" not in caplog.text  # logged once
    assert len(pool_manager._scorer._workers) == 2 and all(w.proc.is_alive() for w in pool_manager._scorer._workers)


def test_pool_charges_only_the_hung_item_of_a_chunk(pool_manager):
    texts = ["ok"] * 10 + ["sleep"] + ["ok"] * 10  # chunks of 3: the hung item sits between finished/pending ones
    out = pool_manager.score(_batch(texts, ["ok"] * 10 + ["x"] + ["ok"] * 10))
    assert out.scores.tolist() == [1.0] * 10 + [-1.0] + [1.0] * 10
    assert out.metrics["reward/timeouts"] == 1 and out.metrics["reward/errors"] == 0


def test_pool_survives_a_dying_worker_and_keeps_healthy_workers(pool_manager):
    scorer = pool_manager._scorer
    out = pool_manager.score(_batch(["ok", "ok"], ["ok", "ok"]))
    pids = {w.proc.pid for w in scorer._workers}
    assert out.scores.tolist() == [1.0, 1.0]
    out = pool_manager.score(_batch(["exit", "ok", "ok", "ok"], ["x", "ok", "ok", "ok"]))
    assert out.scores.tolist() == [-1.0, 1.0, 1.0, 1.0] and out.metrics["reward/errors"] == 1
    new_pids = {w.proc.pid for w in scorer._workers}
    assert len(new_pids & pids) == 1  # exactly the dead worker was replaced; the pool lives on between calls


def test_inline_scorer_times_out_and_counts(tmp_path):
    cfg = _cfg(tmp_path, "reward.num_workers=0", "reward.sources=[{name: custom, weight: 1.0}]")
    with RewardManager(cfg, TOK, R) as manager:
        scores, metrics = manager(_batch(FAILING, TRUTHS))
        assert metrics["reward/errors"] == 3 and metrics["reward/timeouts"] == 2
        assert scores.sum(-1).tolist() == EXPECTED


def test_sequence_reward_on_last_valid_token_matches_naive(tmp_path):
    cfg = load_config([], ["reward.num_workers=0"]).reward
    texts = ["#### 12", "#### 5", "", "x #### 30", "#### 1234567890123456789"]  # empty and truncated responses
    truths = ["12", "6", "1", "30", "1"]
    batch = _batch(texts, truths)
    mask = batch.batch["response_mask"]
    mask[1, 3] = 0  # a hole: the last valid token is still the last 1
    with RewardManager(cfg, TOK, R) as manager:
        token_scores, metrics = manager(batch)
    want = torch.zeros(len(texts), R)
    fn = select_reward_fn("hybridflow/arithmetic")
    for i in range(len(texts)):
        valid = [j for j in range(R) if mask[i, j]]
        last = valid[-1] if valid else 0
        text = TOK.decode(batch.batch["responses"][i, : last + 1], skip_special_tokens=True) if valid else ""
        want[i, last] = fn("hybridflow/arithmetic", text, truths[i], None)["score"]
    assert torch.equal(token_scores, want)
    assert token_scores.dtype == torch.float32 and token_scores[[0, 3]].sum() == 2.0  # the two exact answers
    # One source at weight 1 and one data source: no breakdown repeats the sequence score (the trainer's
    # reward/score/mean); only the scorer's own extras and the failure counts.
    assert set(metrics) == {"reward/errors", "reward/timeouts", "reward/rule/acc"}, sorted(metrics)


@pytest.mark.parametrize("rm_shape", ["sequence", "token"])
def test_mixing_rule_and_model_scores(rm_shape):
    cfg = load_config([], ["reward.num_workers=0",
                           "reward.sources=[{name: rule, weight: 0.3}, {name: model, weight: 0.7}]"]).reward
    texts, truths = ["#### 3", "#### 4", "#### 9"], ["3", "5", "9"]
    rm = torch.tensor([0.5, 2.0, -1.0])
    rm_scores = rm if rm_shape == "sequence" else torch.zeros(3, R).index_put_((torch.arange(3), torch.tensor([5, 5, 5])), rm)
    with RewardManager(cfg, TOK, R) as manager:
        out = manager.score(_batch(texts, truths, rm_scores=rm_scores))
    rule = np.array([1.0, 0.0, 1.0])
    np.testing.assert_allclose(out.scores, 0.3 * rule + 0.7 * rm.numpy(), rtol=1e-6)
    np.testing.assert_allclose(out.source_scores["model"], rm.numpy())
    assert out.metrics["reward/model/mean"] == pytest.approx(float(rm.mean()))
    assert out.metrics["reward/rule/mean"] == pytest.approx(2 / 3)


def test_rm_scores_whitened_by_running_stats_of_training_batches_and_clipped():
    cfg = load_config([], ["reward.num_workers=0", "reward.sources=[{name: model, weight: 1.0}]",
                           "reward.reward_model.score_norm=running", "reward.reward_model.score_clip=1.5"]).reward
    batches = [torch.tensor([0.5, 2.0, -1.0, 7.0]), torch.tensor([3.0, -4.0, 0.0])]
    seen: list[float] = []
    with RewardManager(cfg, TOK, R) as manager:
        for rm in batches:
            seen += rm.tolist()
            token_scores, metrics = manager(_batch(["a"] * len(rm), ["a"] * len(rm), rm_scores=rm))  # updates stats
            expected = np.clip((rm.numpy() - np.mean(seen)) / np.std(seen), -1.5, 1.5)  # naive: all values so far
            assert manager._rm_moments.mean == pytest.approx(np.mean(seen))
            np.testing.assert_allclose(token_scores.sum(-1).numpy(), expected, rtol=1e-6)
            assert "reward/model/mean" not in metrics  # the only source: its mean is the trainer's reward/score/mean
            assert metrics["reward/model/raw_mean"] == pytest.approx(float(rm.mean()))
            assert metrics["reward/model/clip_frac"] == pytest.approx(float((np.abs(expected) >= 1.5).mean()))
        val = manager.score(_batch(["a", "a"], ["a", "a"], rm_scores=torch.tensor([100.0, -100.0])))
        assert manager._rm_moments.count == len(seen)  # validation scores do not move the statistics
    np.testing.assert_allclose(val.source_scores["model"], [1.5, -1.5])


def test_rm_score_norm_and_clip_are_validated():
    with pytest.raises(ValueError, match="reward.reward_model.score_norm"):
        load_config([], ["reward.reward_model.score_norm=batch"])
    with pytest.raises(ValueError, match="reward.reward_model.score_clip"):
        load_config([], ["reward.reward_model.score_clip=0"])


def test_model_source_without_rm_scores_is_a_clear_error():
    cfg = load_config([], ["reward.num_workers=0", "reward.sources=[{name: model, weight: 1.0}]"]).reward
    with RewardManager(cfg, TOK, R) as manager, pytest.raises(ValueError, match="rm_scores"):
        manager(_batch(["a"], ["a"]))


def test_length_and_overlong_penalties_match_the_formulas():
    cfg = load_config([], ["reward.num_workers=0", "reward.length_penalty.enable=true", "reward.length_penalty.coef=0.5",
                           "reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=4",
                           "reward.overlong_buffer.penalty_factor=2.0"]).reward
    texts = ["#### 3", "#### 3" + "\n" * 7, "#### 3" + "\n" * 10]  # 6, 13, 16 tokens, all correct
    with RewardManager(cfg, TOK, R) as manager:
        out = manager.score(_batch(texts, ["3", "3", "3"]))
    for i, n in enumerate([6, 13, 16]):
        overlong = min(-(n - (R - 4)) / 4 * 2.0, 0.0)
        assert out.scores[i] == pytest.approx(out.raw_scores[i] - 0.5 * n / R + overlong)
    assert out.scores[2] == pytest.approx(1.0 - 0.5 - 2.0)
    assert out.metrics["reward/overlong_frac"] == pytest.approx(2 / 3)


def test_per_data_source_metrics_and_rows():
    cfg = load_config([], ["reward.num_workers=0"]).reward
    batch = _batch(["#### 4", "#### 5", "so #### 7", "\\boxed{0.5}"], ["4", "4", "7", "\\frac{1}{2}"],
                   data_sources=["hybridflow/arithmetic", "hybridflow/arithmetic", "openai/gsm8k", "lighteval/MATH"])
    with RewardManager(cfg, TOK, R) as manager:
        out = manager.score(batch)
    assert out.scores.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert out.metrics["reward/hybridflow/arithmetic/score"] == 0.5
    assert out.metrics["reward/openai/gsm8k/score"] == 1.0 and out.metrics["reward/lighteval/MATH/score"] == 1.0
    assert list(out.data_sources) == list(batch.non_tensor_batch["data_source"])


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="reward.custom.path is null"):
        RewardManager(load_config([], ["reward.sources=[{name: custom, weight: 1.0}]"]).reward, TOK, R)
    with pytest.raises(KeyError, match="unknown reward function"):
        RewardManager(load_config([], ["reward.sources=[{name: gsm8kk, weight: 1.0}]"]).reward, TOK, R)
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        RewardManager(load_config([], ["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=99"]).reward,
                      TOK, R)
    with RewardManager(load_config([], ["reward.num_workers=0"]).reward, TOK, R) as manager:
        manager.check_data_sources(["openai/gsm8k", "hybridflow/sort"])
        with pytest.raises(ValueError, match="no reward function for data_source='mystery'"):
            manager.check_data_sources(["openai/gsm8k", "mystery"])
        with pytest.raises(ValueError, match="mystery"):
            manager(_batch(["#### 1"], ["1"], data_sources=["mystery"]))


TYPED_FN = """
import numpy as np
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    kind = solution_str.strip()
    return {"str": "0.75", "boolstr": "True", "none": None, "list": [1.0], "dictstr": {"score": "1"},
            "noscore": {"acc": 1.0}, "int": 1, "bool": True, "npbool": np.bool_(True), "npfloat": np.float32(0.25),
            "dict": {"score": 0.5}}[kind]
"""


def test_rewards_must_be_numbers_else_counted_errors_logged_once_per_kind(tmp_path, caplog):
    path = tmp_path / "typed.py"
    path.write_text(TYPED_FN)
    cfg = load_config([], ["reward.num_workers=0", "reward.error_score=-1.0", f"reward.custom.path={path}",
                           "reward.sources=[{name: custom, weight: 1.0}]"]).reward
    bad = ["str", "boolstr", "none", "list", "dictstr", "noscore", "str"]
    good = ["int", "bool", "npbool", "npfloat", "dict"]
    with RewardManager(cfg, TOK, R) as manager, caplog.at_level(logging.WARNING):
        out = manager.score(_batch(bad + good, ["x"] * 12, data_sources=["my/task"] * 12))
    assert out.scores.tolist() == [-1.0] * 7 + [1.0, 1.0, 1.0, 0.25, 0.5]
    assert out.metrics["reward/errors"] == 7 and out.row_status.tolist() == ["error"] * 7 + ["ok"] * 5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 5  # str (twice in the batch, logged once), NoneType, list, dict's str score, no score
    assert "data_source='my/task' failed (returned str)" in warnings[0] and "'0.75'" in warnings[0]
    assert any("returned NoneType" in w for w in warnings) and any("dict without score" in w for w in warnings)
    assert any("a dict whose 'score' is of type str" in w for w in warnings)


def test_numeric_extras_are_averaged_into_metrics_leaving_out_none():
    cfg = load_config([], ["reward.num_workers=0"]).reward
    call = '<tool_call>{"name":"calculator","arguments":{"expression":"2*3"}}</tool_call>'
    texts = [f"{call} #### 6", "<tool_call>{oops}</tool_call> #### 6", "#### 5"]  # good call, malformed, no call
    with RewardManager(cfg, TOK, 96) as manager:
        out = manager.score(_batch(texts, ["6"] * 3, ["hybridflow/tool_calculator"] * 3, width=96))
    assert out.scores.tolist() == [1.0, 1.0, 0.0]
    m = out.metrics
    assert m["reward/rule/acc"] == pytest.approx(2 / 3) and m["reward/rule/called"] == pytest.approx(2 / 3)
    assert m["reward/rule/well_formed"] == pytest.approx(0.5)  # the row without calls is left out (None)
    assert m["reward/rule/tool_calls"] == pytest.approx(2 / 3)


def test_extras_means_skips_what_is_not_a_finite_number():
    from hybridflow.rewards.manager import extras_means

    column = np.array([1, 0.5, None, "x", float("nan"), True], dtype=object)
    assert extras_means({"rule/k": column, "rule/none": np.array([None, "y"], dtype=object)}) == {
        "rule/k": pytest.approx((1 + 0.5 + 1) / 3)}
