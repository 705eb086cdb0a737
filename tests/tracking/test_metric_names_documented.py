"""Every metric a command emits is documented in docs/metrics.md: one step of `train` (GRPO on the built-in
arithmetic task, with validation), `train` (PPO with a critic, KL in the reward and a KL loss, two custom reward
functions from a list, penalties), `sft`, `rm` and `dpo`, each through the CLI into its run directory's
metrics.jsonl; every key there must match a name the page lists. Placeholders (`<source>`, ...) match the values
the page defines for them, and `{a,b}` lists alternatives."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

import hybridflow.tracking
from hybridflow.cli import main
from hybridflow.commands.quickstart import QUICKSTART_YAML

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
ROW_FIELDS = {"step", "time"}  # metrics.jsonl's own fields, not metrics
NAME = re.compile(r"[a-z{<][A-Za-z0-9_{},<>]*(?:/[A-Za-z0-9_.<>{},-]+)*")
REWARD = ("def exact(data_source, solution_str, ground_truth, extra_info=None):\n"
          "    return float(solution_str.strip() == ground_truth)\n"
          "def short(data_source, solution_str, ground_truth, extra_info=None):\n"
          "    return {'score': -len(solution_str) / 10, 'chars': len(solution_str)}\n")
DATA_SOURCE = "hybridflow/arithmetic"
# What each placeholder stands for in these runs (the page says what it stands for in general).
PLACEHOLDERS = {"source": "rule|custom|model|exact|short", "data_source": re.escape(DATA_SOURCE),
                "key": "[A-Za-z0-9_]+", "tool": "[A-Za-z0-9_]+"}
COMMON = ["trainer.device=cpu", "trainer.backend=local", "trainer.logger=[jsonl]",
          "trainer.resume_mode=disable", "trainer.checkpoint.save_freq=0"]


def documented_patterns(text: str) -> list[re.Pattern[str]]:
    """The backticked metric names of the page's metric sections (up to "Files in"), as regexes."""
    text = text.split("## Files in", 1)[0]
    patterns = []
    for token in re.findall(r"`([^`\s]+)`", text):
        if not NAME.fullmatch(token) or ("/" not in token and "_" not in token):
            continue
        for name in _expand_braces(token):
            regex = ""
            for part in re.split(r"(<[a-z_]+>)", name):
                if part.startswith("<"):
                    assert part[1:-1] in PLACEHOLDERS, f"docs/metrics.md uses an undefined placeholder {part}"
                    regex += f"(?:{PLACEHOLDERS[part[1:-1]]})"
                else:
                    regex += re.escape(part)
            patterns.append(re.compile(regex))
    return patterns


def _expand_braces(name: str) -> list[str]:
    parts = re.split(r"\{([^}]*)\}", name)  # literal, alternatives, literal, ...
    options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(choice) for choice in itertools.product(*options)]


def _keys(run_dir: Path) -> set[str]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {k for row in rows for k in row} - ROW_FIELDS


@pytest.fixture(scope="module")
def emitted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    tmp = tmp_path_factory.mktemp("metric_names")
    (tmp / "reward.py").write_text(REWARD)
    tiny = ["data.train_size=8", "data.val_size=4", "data.train_batch_size=4", "rollout.n=2",
            "actor.ppo_mini_batch_size=4", "critic.ppo_mini_batch_size=4", "trainer.total_training_steps=1",
            "trainer.val_before_train=true", "trainer.test_freq=1", "data.max_response_length=6"]
    supervised = ["trainer.val_before_train=false", "trainer.test_freq=1", "data.task=arithmetic",
                  "data.train_size=8", "data.val_size=4"]
    runs = {
        "grpo": ["train", "--quiet-config", str(QUICKSTART_YAML), *tiny],
        "ppo": ["train", "--quiet-config", str(QUICKSTART_YAML), *tiny, "algorithm.adv_estimator=gae", "algorithm.use_kl_in_reward=true",
                "actor.use_kl_loss=true", "reward.length_penalty.enable=true", "reward.overlong_buffer.enable=true",
                "reward.overlong_buffer.len=2",
                f"reward.custom=[{{path: {tmp}/reward.py, name: exact}}, {{path: {tmp}/reward.py, name: short}}]",
                "reward.sources=[{name: rule, weight: 0.5}, {name: custom, weight: 0.5}]"],
        "sft": ["sft", *supervised, "sft.total_steps=1", "sft.batch_size=4", "sft.micro_batch_size_per_gpu=4"],
        "rm": ["rm", *supervised, "rm.total_steps=1", "rm.batch_size=4", "rm.micro_batch_size_per_gpu=4"],
        "dpo": ["dpo", *supervised, "dpo.total_steps=1", "dpo.batch_size=4", "dpo.micro_batch_size_per_gpu=4",
                f"dpo.export_dir={tmp}/dpo_hf"],
    }
    out = {}
    for name, (command, *args) in runs.items():
        run_dir = tmp / name
        assert main([command, *args, *COMMON, f"trainer.run_dir={run_dir}/run",
                     f"trainer.default_local_dir={run_dir}/ckpt"]) == 0, name
        out[name] = _keys(run_dir / "run")
    return out


@pytest.mark.parametrize("command", ["grpo", "ppo", "sft", "rm", "dpo"])
def test_every_emitted_metric_is_documented(emitted: dict[str, set[str]], command: str) -> None:
    patterns = documented_patterns(DOC.read_text())
    missing = sorted(k for k in emitted[command] if not any(p.fullmatch(k) for p in patterns))
    assert not missing, f"{command} emits metrics docs/metrics.md does not list: {missing}"


def test_one_name_per_reward_value(emitted: dict[str, set[str]]) -> None:
    grpo, ppo = emitted["grpo"], emitted["ppo"]
    # One source, one data source, no KL in reward: the sequence score has one name.
    assert {"reward/score/mean", "val/reward"} <= grpo
    assert not {"reward/mean", "reward/rule/mean", f"reward/{DATA_SOURCE}/score", "reward/kl_penalized/mean"} & grpo
    # Several sources (rule + two custom functions from a list) and KL in reward: breakdowns of their own.
    assert {"reward/rule/mean", "reward/exact/mean", "reward/short/mean", "reward/short/chars",
            "reward/kl_penalized/mean", "critic/vf_loss"} <= ppo


def test_an_undocumented_metric_fails() -> None:
    patterns = documented_patterns(DOC.read_text())
    assert any(p.fullmatch("reward/score/mean") for p in patterns)
    assert any(p.fullmatch(f"val/{DATA_SOURCE}/accuracy") for p in patterns)
    for name in ("reward/mean", "reward/reward/mean", "actor/made_up", "reward/made_up/mean"):
        assert not any(p.fullmatch(name) for p in patterns), name


def test_the_keys_console_report_and_health_checks_read_are_documented() -> None:
    """A reader of a key nobody emits shows an empty panel forever (the report once read `perf/mfu/actor`, which
    the engine logs as `actor/mfu`)."""
    patterns = documented_patterns(DOC.read_text())
    labels = {"nats/token", "tok/s/gpu"}  # axis units, not keys
    tracking = Path(hybridflow.tracking.__file__).parent
    read = {key for name in ("console.py", "report.py", "plots.py", "health.py")
            for key in re.findall(r'"([a-z_]+/[A-Za-z0-9_/]*[A-Za-z0-9_])"', (tracking / name).read_text())}
    assert {"reward/score/mean", "actor/mfu", "timing/update_actor"} <= read  # the scan sees the readers' keys
    unknown = sorted(k for k in read - labels if not any(p.fullmatch(k) for p in patterns))
    assert not unknown, f"hybridflow/tracking reads keys docs/metrics.md does not list: {unknown}"
