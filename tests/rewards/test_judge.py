"""LLM-as-judge rewards: template filling, verdict parsing (regex and a user function), unparsed verdicts and errors
scored `fallback_score` and counted, mixing with rule rewards by weight, and a tiny random-init judge run through
our rollout engine in batches (compared with HF greedy generate)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridflow.config import load_config
from hybridflow.models.loader import save_pretrained
from hybridflow.models.presets import preset_config
from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rewards import RewardManager
from hybridflow.rewards.judge import ERROR, OK, UNPARSED, build_parser, read_verdicts, render
from hybridflow.trainer.judge import build_judge

TOK = builtin_tokenizer()
TEMPLATE = "Q:{prompt} A:{response} T:{ground_truth} V:"


def test_render_fills_each_placeholder_once() -> None:
    text = render("{prompt}|{response}|{ground_truth}|{other}", "What is 2+2?", "#### {ground_truth}", 4)
    assert text == "What is 2+2?|#### {ground_truth}|4|{other}"  # the response's "{ground_truth}" stays text
    assert render("T:{ground_truth}", "p", "r", None) == "T:"


def test_regex_parser_reads_the_first_group_as_a_number() -> None:
    parse = build_parser(r"Score: *(-?[0-9.]+)")
    assert parse("blah Score: 0.75 then Score: 1") == 0.75
    assert parse("no verdict") is None
    assert build_parser(r"Verdict: (\w+)")("Verdict: yes") is None  # a group that is not a number: unparsed


def test_function_parser_is_loaded_from_a_file(tmp_path) -> None:
    (tmp_path / "verdict.py").write_text("def yes_no(text):\n    return {'yes': 1.0, 'no': 0.0}.get(text.strip())\n")
    parse = build_parser("unused", f"{tmp_path / 'verdict.py'}:yes_no")
    assert (parse(" yes"), parse("no"), parse("maybe")) == (1.0, 0.0, None)


def test_unparsed_and_failed_verdicts_score_the_fallback_and_are_counted() -> None:
    def parse(text: str):
        if text == "boom":
            raise RuntimeError("parser bug")
        return {"1": 1.0, "nan": float("nan"), "bool": True, "half": 0.5}.get(text)

    status = np.array([OK, OK, OK, OK, OK, OK, ERROR], dtype=object)  # the last row: prompt too long, not judged
    v = read_verdicts(["1", "half", "nan", "bool", "??", "boom", ""], parse, -1.0, status)
    assert v.scores.tolist() == [1.0, 0.5, -1.0, -1.0, -1.0, -1.0, -1.0]
    assert v.status.tolist() == [OK, OK, UNPARSED, UNPARSED, UNPARSED, ERROR, ERROR]
    assert v.metrics() == {"reward/judge_unparsed": 3.0, "reward/judge_errors": 2.0}


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"reward.judge.verdict_regex.*exactly one group"):
        load_config([], ["reward.judge.verdict_regex=Score"])
    with pytest.raises(ValueError, match=r"reward.judge.path.*names 'judge'"):
        load_config([], ["reward.sources=[{name: judge, weight: 1.0}]"])
    with pytest.raises(ValueError, match=r"reward.judge.verdict_fn"):
        load_config([], ["reward.judge.verdict_fn=verdict"])
    with pytest.raises(ValueError, match=r"reward.judge.template.*\{response\}"):
        load_config([], ["reward.judge.template='{prompt} Score:'"])
    cfg = load_config([], ["reward.sources=[{name: judge, weight: 1.0}]", "reward.judge.path=/j"])
    with pytest.raises(ValueError, match="build_judge"):  # a judge source needs the judge model handed in
        RewardManager(cfg.reward, TOK, max_response_length=8)


# ------------------------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    """A tiny random-init Llama-family judge with the built-in character tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = preset_config("tiny", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1)
    return save_pretrained(AutoModelForCausalLM.from_config(cfg), tmp_path_factory.mktemp("judge"), TOK)


def _batch(prompts: list[str], responses: list[str], truths: list[str]) -> DataProto:
    def left(texts: list[str]) -> torch.Tensor:
        rows = [TOK(t, add_special_tokens=False)["input_ids"] for t in texts]
        w = max(map(len, rows))
        return torch.tensor([[TOK.pad_token_id] * (w - len(r)) + r for r in rows])

    resp = torch.tensor([TOK(t, add_special_tokens=False)["input_ids"] for t in responses])  # equal lengths here
    return DataProto.from_dict({"prompts": left(prompts), "responses": resp, "response_mask": torch.ones_like(resp)},
                               {"data_source": ["hybridflow/arithmetic"] * len(responses),
                                "reward_model": [{"ground_truth": t} for t in truths]})


def _manager(judge_dir, tmp_path, verdict: str | None, *overrides: str) -> RewardManager:
    fn = None
    if verdict is not None:
        (tmp_path / "verdict.py").write_text(f"def verdict(text):\n    return {verdict}\n")
        fn = f"{tmp_path / 'verdict.py'}:verdict"
    cfg = load_config([], [f"reward.judge.path={judge_dir}", f"reward.judge.template={TEMPLATE!r}",
                           f"reward.judge.verdict_fn={fn or 'null'}", "reward.judge.max_new_tokens=6",
                           "reward.judge.fallback_score=-2.0", *overrides])
    return RewardManager(cfg.reward, TOK, max_response_length=8, judge=build_judge(cfg.reward))


PROMPTS = ["What is 12+30?", "What is 01+01?", "What is 99+99?", "What is 50+05?", "What is 07+08?"]
RESPONSES = ["#### 42", "#### 03", "#### 98", "#### 55", "#### 15"]
TRUTHS = ["42", "2", "198", "55", "15"]


def test_judge_batches_through_the_engine_like_hf_greedy(judge_dir, tmp_path) -> None:
    with _manager(judge_dir, tmp_path, None, "reward.sources=[{name: judge, weight: 1.0}]",
                  "reward.judge.batch_size=2") as manager:
        judge, calls = manager.judge, []
        generate = judge.engine.generate
        judge.engine.generate = lambda data, sampling: calls.append(len(data)) or generate(data, sampling)
        out = manager.score(_batch(PROMPTS, RESPONSES, TRUTHS))
        assert calls == [2, 2, 1]  # batch_size prompts per generate call
        verdicts = judge(PROMPTS, RESPONSES, TRUTHS)  # greedy: the same texts again
    expected = []
    for p, r, t in zip(PROMPTS, RESPONSES, TRUTHS):  # HF greedy generate, one prompt at a time, as the reference
        ids = torch.tensor([TOK(render(TEMPLATE, p, r, t), add_special_tokens=False)["input_ids"]])
        gen = judge.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                                   eos_token_id=TOK.eos_token_id, pad_token_id=TOK.pad_token_id)
        expected.append(TOK.decode(gen[0, ids.shape[1]:].tolist(), skip_special_tokens=True))
    assert verdicts.texts == expected
    parsed = [build_parser(judge.cfg.verdict_regex)(t) for t in expected]
    assert out.source_scores["judge"].tolist() == [-2.0 if v is None else v for v in parsed]
    assert out.metrics["reward/judge_unparsed"] == sum(v is None for v in parsed)


def test_judge_mixes_with_rule_rewards_by_weight(judge_dir, tmp_path) -> None:
    sources = "reward.sources=[{name: rule, weight: 1.0}, {name: judge, weight: 0.5}]"
    with _manager(judge_dir, tmp_path, "0.25", sources) as manager:
        out = manager.score(_batch(PROMPTS, RESPONSES, TRUTHS))
    rule = out.source_scores["rule"]
    assert rule[0] == 1.0 and rule[1] == 0.0  # exact; wrong
    np.testing.assert_allclose(out.scores, rule + 0.5 * 0.25)
    assert out.metrics["reward/judge/mean"] == 0.25 and out.metrics["reward/judge_unparsed"] == 0.0


def test_unparsed_verdicts_and_too_long_prompts_get_the_fallback(judge_dir, tmp_path) -> None:
    with _manager(judge_dir, tmp_path, "None", "reward.sources=[{name: judge, weight: 1.0}]",
                  "reward.judge.max_prompt_length=34") as manager:
        out = manager.score(_batch(PROMPTS, RESPONSES, TRUTHS))
    # "Q:What is 99+99? A:#### 98 T:198 V:" is 35 characters: not judged (an error); the others are unparsed
    assert out.scores.tolist() == [-2.0] * 5
    assert (out.metrics["reward/judge_unparsed"], out.metrics["reward/judge_errors"]) == (4.0, 1.0)


def test_preflight_accepts_a_judge_source_and_checks_its_directory(judge_dir) -> None:
    from hybridflow.preflight import preflight_errors

    sources = "reward.sources=[{name: judge, weight: 1.0}]"
    good = load_config([], [sources, f"reward.judge.path={judge_dir}"])
    assert preflight_errors(good, data=False) == []
    bad = load_config([], [sources, f"reward.judge.path={judge_dir.parent}/none/judge"])
    assert any("reward.judge.path" in e and "config.json" in e for e in preflight_errors(bad, data=False))
