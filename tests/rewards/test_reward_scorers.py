"""Rule scorers: gsm8k strict/flexible, math (math-verify and the fallback normaliser), countdown, registry."""

from __future__ import annotations

import pytest

from hybridflow.rewards import REWARD_FUNCTIONS, select_reward_fn
from hybridflow.rewards import math as math_reward
from hybridflow.rewards.countdown import countdown, evaluate
from hybridflow.rewards.custom import load_custom_fn
from hybridflow.rewards.gsm8k import extract_answer, gsm8k, gsm8k_flexible


@pytest.mark.parametrize("text, strict, flexible", [
    ("so the total is 18.\n#### 18", "18", "18"),
    ("#### 1,000", "1000", "1000"),
    ("#### -3", "-3", "-3"),
    ("The answer is 42.", None, "42"),
    ("#### 5 then later 7", "5", "7"),
    ("#### 3\n#### 4", "4", "4"),
    ("no numbers here", None, None),
    ("####18", None, "18"),  # strict needs the space the instruction shows
])
def test_gsm8k_extraction(text, strict, flexible):
    assert extract_answer(text, "strict") == strict
    assert extract_answer(text, "flexible") == flexible


def test_gsm8k_scores():
    assert gsm8k("openai/gsm8k", "reasoning #### 72", "72", None) == 1.0
    assert gsm8k("openai/gsm8k", "#### 72.0", "72", None) == 1.0  # compared by value
    assert gsm8k("openai/gsm8k", "#### 1,200", "1200", None) == 1.0
    assert gsm8k("openai/gsm8k", "#### 71", "72", None) == 0.0
    assert gsm8k("openai/gsm8k", "it is 72", "72", None) == 0.0
    assert gsm8k_flexible("openai/gsm8k", "it is 72", "72", None) == 1.0
    assert gsm8k("openai/gsm8k", "x" * 5000 + "#### 9", "9", None) == 1.0  # only the tail is searched


def test_last_boxed():
    assert math_reward.last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert math_reward.last_boxed("\\boxed{x^{2}}") == "x^{2}"
    assert math_reward.last_boxed("\\boxed 5$") == "5"
    assert math_reward.last_boxed("\\boxed{unbalanced") is None
    assert math_reward.last_boxed("nothing") is None


EQUIVALENT = [("\\frac{1}{2}", "0.5"), ("\\frac{1}{2}", "\\dfrac{1}{2}"), ("\\frac12", "\\frac{1}{2}"),
              ("3", "3.0"), ("10", "10\\text{ cm}"), ("-\\frac{2}{4}", "-0.5"), ("5", "x = 5")]
SYMBOLIC = [("\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2"), ("x^2+2x+1", "(x+1)^2"), ("\\pi", "\\pi")]
DIFFERENT = [("\\frac{1}{2}", "0.6"), ("3", "4"), ("x+1", "x+2")]


@pytest.mark.skipif(math_reward._mv_parse is None, reason="math-verify not installed")
@pytest.mark.parametrize("truth, answer", EQUIVALENT + SYMBOLIC)
def test_math_equivalences_with_math_verify(truth, answer):
    assert math_reward.math_score("lighteval/MATH", f"so \\boxed{{{answer}}}", truth, None) == 1.0


@pytest.mark.parametrize("truth, answer", DIFFERENT)
def test_math_rejects_wrong_answers(truth, answer):
    assert math_reward.math_score("lighteval/MATH", f"\\boxed{{{answer}}}", truth, None) == 0.0


@pytest.mark.parametrize("truth, answer", EQUIVALENT)
def test_math_fallback_normaliser(monkeypatch, truth, answer):
    monkeypatch.setattr(math_reward, "_mv_parse", None)
    assert math_reward.math_score("lighteval/MATH", f"\\boxed{{{answer}}}", truth, None) == 1.0


def test_math_fallback_rejects_and_needs_a_box(monkeypatch):
    monkeypatch.setattr(math_reward, "_mv_parse", None)
    for truth, answer in DIFFERENT:
        assert math_reward.math_score("lighteval/MATH", f"\\boxed{{{answer}}}", truth, None) == 0.0
    assert math_reward.math_score("lighteval/MATH", "the answer is 0.5", "0.5", None) == 0.0
    assert math_reward.math_score("lighteval/MATH", "\\boxed{2}", "\\boxed{2}", None) == 1.0  # boxed truth


def test_countdown():
    gt = {"target": 24, "numbers": [4, 6, 1]}
    assert countdown("countdown", "<answer>4*6*1</answer>", gt, None) == 1.0
    assert countdown("countdown", "<answer>(4*6)/1</answer>", gt, None) == 1.0
    assert countdown("countdown", "<answer>4*6</answer>", gt, None) == 0.1  # a number unused
    assert countdown("countdown", "<answer>4+6+1</answer>", gt, None) == 0.1  # wrong value
    assert countdown("countdown", "<answer>__import__('os')</answer>", gt, None) == 0.0
    assert countdown("countdown", "4*6*1", gt, None) == 0.0
    assert evaluate("2**3") is None and evaluate("1/0") is None and evaluate("(1+2)*3") == 9


def test_select_reward_fn_by_data_source():
    assert select_reward_fn("openai/gsm8k") is REWARD_FUNCTIONS["gsm8k"]
    for ds in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert select_reward_fn(ds) is REWARD_FUNCTIONS["math"]
    assert select_reward_fn("hybridflow/arithmetic") is REWARD_FUNCTIONS["arithmetic"]
    assert select_reward_fn("countdown") is REWARD_FUNCTIONS["countdown"]
    assert select_reward_fn("gsm8k_flexible") is REWARD_FUNCTIONS["gsm8k_flexible"]  # a registered name
    with pytest.raises(ValueError, match="no reward function for data_source='my/data'.*reward.custom.path"):
        select_reward_fn("my/data")


def test_custom_function_from_a_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return float(solution_str.strip() == ground_truth) + extra_info['bonus']\n"
                    "def old_style(solution_str, ground_truth):\n    return 0.25\n")
    fn = load_custom_fn(str(path), "compute_score")
    assert fn("any", " yes ", "yes", {"bonus": 0.5}) == 1.5
    assert load_custom_fn(str(path), "old_style")("any", "s", "g", None) == 0.25  # missing params dropped
    with pytest.raises(ValueError, match="not a function.*compute_score"):
        load_custom_fn(str(path), "nope")
    with pytest.raises(ValueError, match="is not a file"):
        load_custom_fn(str(tmp_path / "missing.py"), "compute_score")


@pytest.mark.parametrize(
    "text,truth,score,acc",
    [("#### 152", "152", 1.0, 1.0), ("#### 150", "152", 0.5 * 2 / 3, 0.0), ("#### 52", "152", 0.5 * 2 / 3, 0.0),
     ("#### 1520", "152", 0.0, 0.0), ("no answer", "152", 0.0, 0.0), ("#### abc", "12", 0.0, 0.0),
     ("#### 12.", "12", 1.0, 1.0)],
)
def test_arithmetic_partial_digit_credit_and_exact_accuracy(text: str, truth: str, score: float, acc: float) -> None:
    out = REWARD_FUNCTIONS["arithmetic"]("hybridflow/arithmetic", text, truth, None)
    assert out["score"] == pytest.approx(score)
    assert out["acc"] == acc
