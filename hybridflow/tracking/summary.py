"""The closing summary of a training or evaluation command, built from the run's metric rows (metrics.jsonl).

Every command ends with the same block: how it ended (finished / interrupted / failed, at which step, how long), the
validation metrics before → after with what each one counts, the best step, where the checkpoint and the exported
model are, and the next command — with the user's own config files, so the next step runs on the same task.
What a metric means depends on the method that logged it (`val/accuracy` is greedy task accuracy for RL, preference
accuracy for a reward model), so `metric_meaning` is the one place that says it; the report's cards use it too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.tracking.console import fmt_duration

Rows = Sequence[dict[str, Any]]

# The method that logged a run, told by its training metrics' namespace (for a run read back from metrics.jsonl).
METHOD_NAMESPACES = (("dpo/loss", "dpo"), ("rm/loss", "rm"), ("sft/loss", "sft"), ("online_dpo/pairs", "online_dpo"))
METHOD_TITLES = {"ppo": "RL training", "sft": "SFT", "rm": "reward model", "dpo": "DPO", "online_dpo": "online DPO",
                 "eval": "evaluation"}
IMPLICIT_ACCURACY = "val/rewards/accuracies"  # DPO's implicit-reward preference accuracy (TRL's name)
TOTAL_STEPS = "training/total_steps"  # logged by the tracker once a run knows its step count


@dataclass(frozen=True)
class MetricSpec:
    key: str
    kind: str  # "accuracy" (shown in %, higher is better) | "loss" (lower is better) | "score" (higher is better)


@dataclass(frozen=True)
class Outcome:
    """What the command knows about its run besides the metrics."""

    method: str  # ppo | sft | rm | dpo | online_dpo | eval
    status: str = "finished"  # finished | interrupted | failed
    seconds: float | None = None
    total_steps: int | None = None
    error: str | None = None
    checkpoint: Path | None = None  # the latest checkpoint directory, if any
    resumable: bool = True  # trainer.resume_mode is not `disable`
    export: Path | None = None  # the exported HF model directory
    run_dir: Path | None = None
    next_commands: tuple[str, ...] = field(default_factory=tuple)
    title: str | None = None  # e.g. "GRPO training" or "IPO"; default from METHOD_TITLES
    notes: tuple[str, ...] = ()  # lines the command adds under the headline


def method_of(rows: Rows) -> str:
    """ppo | sft | rm | dpo | online_dpo, from the training metrics the rows hold."""
    keys = {k for r in rows for k in r}
    return next((method for key, method in METHOD_NAMESPACES if key in keys), "ppo")


def decoding(config: dict[str, Any]) -> str:
    v = (config.get("rollout") or {}).get("val_kwargs") or {}
    if v.get("do_sample"):
        return f"sampled at temperature {float(v.get('temperature', 1.0)):g}"
    return "greedy"


def accuracy_rule(config: dict[str, Any]) -> str:
    """What `val/accuracy` counts for a scored task (docs/metrics.md): the scorer's `acc`, else the threshold."""
    threshold = (config.get("reward") or {}).get("success_threshold", 1.0)
    return f"correct = the scorer's acc, else score ≥ {threshold:g} (reward.success_threshold)"


def metric_meaning(key: str, method: str, rows: Rows, config: dict[str, Any]) -> str:
    """What `key` counts in a run of `method`, in words (for the summary and the report's cards)."""
    keys = {k for r in rows for k in r}
    task_accuracy = f"task accuracy, {decoding(config)}; {accuracy_rule(config)}"
    if key == "val/accuracy":
        if method == "rm":
            return "preference accuracy: the reward model scores chosen above rejected"
        if method == "dpo" and IMPLICIT_ACCURACY not in keys:
            return "implicit-reward preference accuracy: β·log(π/π_ref) of chosen above rejected"
        return task_accuracy
    meanings = {
        IMPLICIT_ACCURACY: "implicit-reward preference accuracy: β·log(π/π_ref) of chosen above rejected",
        "val/logp_accuracy": "the policy's own log π(chosen) above log π(rejected)",
        "val/token_accuracy": "greedy next token = the target token",
        "val/loss": f"{METHOD_TITLES.get(method, method)} loss on held-out data",
        "val/reward": f"mean reward of the {decoding(config)} responses",
    }
    return meanings.get(key, key)


def summary_metrics(method: str, rows: Rows) -> list[MetricSpec]:
    """The validation metrics the summary shows for a run of `method`, in order, when present."""
    keys = {k for r in rows for k in r}
    order = {"sft": ("val/accuracy", "val/loss", "val/token_accuracy"),
             "rm": ("val/accuracy", "val/loss"),
             "dpo": ("val/accuracy", IMPLICIT_ACCURACY, "val/loss")}.get(method, ("val/accuracy", "val/reward"))
    kinds = {"val/loss": "loss", "val/reward": "score"}
    return [MetricSpec(k, kinds.get(k, "accuracy")) for k in order if k in keys]


def _fmt(kind: str, value: float) -> str:
    return f"{100 * value:.1f}%" if kind == "accuracy" else f"{value:.4g}"


def _change(kind: str, first: float, last: float) -> str:
    if kind == "accuracy":
        return f"{100 * (last - first):+.1f} points"
    return f"{last - first:+.4g}"


def metric_line(spec: MetricSpec, rows: Rows) -> str | None:
    """`key first → last (change) · best B at step S`, or `key value` when measured once; None when absent."""
    pts = [(int(r.get("step", 0)), float(r[spec.key])) for r in rows
           if r.get(spec.key) is not None and math.isfinite(float(r[spec.key]))]
    if not pts:
        return None
    (s0, first), (s1, last) = pts[0], pts[-1]
    if len(pts) == 1:
        return f"{spec.key} {_fmt(spec.kind, last)}" + (f" (step {s1})" if s1 else "")
    best_step, best = (min if spec.kind == "loss" else max)(pts, key=lambda p: p[1])
    return (f"{spec.key} {_fmt(spec.kind, first)} → {_fmt(spec.kind, last)} ({_change(spec.kind, first, last)}, "
            f"step {s0} → {s1}) · best {_fmt(spec.kind, best)} at step {best_step}")


def headline(outcome: Outcome, rows: Rows) -> str:
    title = outcome.title or METHOD_TITLES.get(outcome.method, outcome.method)
    steps = [int(r.get("step", 0)) for r in rows]
    last = max(steps, default=0)
    of = f" of {outcome.total_steps}" if outcome.total_steps else ""
    took = f" in {fmt_duration(outcome.seconds)}" if outcome.seconds is not None else ""
    if outcome.method == "eval":
        return f"{title} {outcome.status}{took}"
    if outcome.status == "finished":
        return f"{title} finished: {last}{of} steps{took}"
    line = f"{title} {outcome.status} at step {last}{of}{took.replace(' in ', ' after ')}"
    return line + (f": {outcome.error}" if outcome.error else "")


def build_summary(outcome: Outcome, rows: Rows, config: dict[str, Any]) -> list[str]:
    """The closing summary's lines (plain text, no markup)."""
    lines = [headline(outcome, rows), *outcome.notes]
    for spec in summary_metrics(outcome.method, rows):
        text = metric_line(spec, rows)
        if text is not None:
            lines.append(text)
            lines.append(f"  ({metric_meaning(spec.key, outcome.method, rows, config)})")
    if len(lines) == 1 + len(outcome.notes) and outcome.method != "eval" and outcome.status == "finished":
        lines.append("no validation metrics (no validation data, or the run stopped before the first)")
    if outcome.export is not None and outcome.status == "finished":
        lines.append(f"model (Hugging Face directory): {outcome.export}")
    if outcome.checkpoint is not None:
        lines.append(f"checkpoint: {outcome.checkpoint}")
        if outcome.status != "finished":
            lines.append("rerun the same command to resume from it" if outcome.resumable else
                         "trainer.resume_mode=disable: a rerun starts over (trainer.resume_mode=auto resumes)")
    elif outcome.status != "finished" and outcome.method != "eval" and rows:
        lines.append("no checkpoint was written: a rerun starts over (trainer.checkpoint.save_freq sets how often)")
    if outcome.run_dir is not None and rows:
        lines.append(f"metrics: {outcome.run_dir}/metrics.jsonl · report: hybridflow report {outcome.run_dir}")
    if outcome.next_commands and outcome.status == "finished":
        lines.append("next: " + outcome.next_commands[0])
        lines += ["      " + cmd for cmd in outcome.next_commands[1:]]
    return lines
