"""Matplotlib figures for the run report, one per report section, drawn from merged metrics.jsonl rows.

One style for all figures (fonts, grid, fixed colours per metric, stage colours in pipeline order) so the same
metric looks the same everywhere. Noisy series are drawn raw (faint) plus a rolling mean; a panel whose metrics
are absent is dropped and a figure with no panels is skipped, so partial runs and SFT runs render too.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

Rows = Sequence[dict[str, Any]]
STAGES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "switch")
STAGE_COLORS = dict(zip(STAGES, ("#4C78A8", "#F58518", "#54A24B", "#B279A2", "#E45756", "#9D755D",
                                 "#FF9DA6", "#72B7B2", "#EECA3B")))
C = {"train": "#2563EB", "val": "#EA580C", "kl": "#7C3AED", "kl2": "#A78BFA", "kl3": "#C026D3",
     "entropy": "#059669", "pg": "#2563EB", "vf": "#DB2777", "grad": "#0F766E", "grad2": "#D97706",
     "resp": "#0891B2", "prompt": "#64748B", "clip": "#DC2626", "tput": "#2563EB", "mfu": "#EA580C",
     "gpu": "#DC2626", "cpu": "#64748B", "other": "#CBD5E1"}
CYCLE = ("#2563EB", "#EA580C", "#059669", "#7C3AED", "#DB2777", "#0891B2", "#CA8A04", "#64748B")
STYLE = {
    "font.size": 11, "axes.titlesize": 12.5, "axes.titleweight": "bold", "axes.titlepad": 8,
    "axes.labelsize": 10.5, "axes.labelcolor": "#334155", "xtick.labelsize": 9.5, "ytick.labelsize": 9.5,
    "xtick.color": "#475569", "ytick.color": "#475569", "axes.edgecolor": "#94A3B8",
    "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.color": "#E2E8F0",
    "grid.linewidth": 0.8, "legend.frameon": False, "legend.fontsize": 9.5, "lines.linewidth": 1.8,
    "axes.axisbelow": True, "figure.facecolor": "white", "axes.facecolor": "white", "savefig.facecolor": "white",
}
FIG_W, FIG_H = 12.0, 3.9


@dataclass(frozen=True)
class FigureSpec:
    name: str  # file stem for --png and the HTML anchor
    title: str  # section heading in the report
    panels: tuple[Callable[[Any, Rows, dict[str, Any]], bool], ...]  # each draws on an Axes; False = no data


def series(rows: Rows, key: str, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values × scale) of `key`, skipping rows where it is missing or null."""
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    if not pts:
        return np.zeros(0), np.zeros(0)
    x, y = zip(*pts)
    return np.asarray(x, dtype=float), np.asarray(y, dtype=float) * scale


def has(rows: Rows, *keys: str) -> bool:
    return any(r.get(k) is not None for r in rows for k in keys)


def smooth(y: np.ndarray) -> np.ndarray | None:
    """Centered-ish rolling mean with a window of ~4% of the points; None when the series is short."""
    w = len(y) // 25
    if w < 2:
        return None
    kernel = np.ones(w) / w
    pad = np.pad(y, (w // 2, w - 1 - w // 2), mode="edge")
    return np.convolve(pad, kernel, mode="valid")


def line(ax: Any, rows: Rows, key: str, color: str, label: str | None = None, marker: str | None = None,
         scale: float = 1.0, raw: bool = False, **kw: Any) -> bool:
    """Plot `key` (raw faint + smoothed when long enough, unless `raw` or markers: peaks and sparse points must
    stay visible); returns False when there is nothing to plot."""
    x, y = series(rows, key, scale)
    if not len(x):
        return False
    label = label or key
    s = smooth(y) if marker is None and not raw else None
    if s is None:
        ax.plot(x, y, color=color, label=label, marker=marker, markersize=4 if marker else None, **kw)
    else:
        ax.plot(x, y, color=color, alpha=0.25, linewidth=1.0)
        ax.plot(x, s, color=color, label=label, **kw)
    return True


def band(ax: Any, rows: Rows, lo: str, hi: str, color: str, label: str | None = None) -> None:
    x1, ylo = series(rows, lo)
    x2, yhi = series(rows, hi)
    if len(x1) and len(x1) == len(x2) and np.array_equal(x1, x2):
        ax.fill_between(x1, ylo, yhi, color=color, alpha=0.12, linewidth=0, label=label)


def finish(ax: Any, title: str, ylabel: str, legend: bool = True) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_title(title, loc="left")
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best")


# --------------------------------------------------------------------------------------------------- panels
def p_reward(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    band(ax, rows, "reward/score/min", "reward/score/max", C["train"], "train min–max")
    ok = line(ax, rows, "reward/score/mean", C["train"], "train reward (mean)")
    ok |= line(ax, rows, "val/reward", C["val"], "val/reward", marker="o")
    for i, ev in enumerate(ctx.get("warnings", [])):
        ax.axvline(ev["step"], color="#DC2626", alpha=0.45, linestyle=":", linewidth=1.2,
                   label="health warning" if i == 0 else None)
    finish(ax, "Reward", "score")
    return ok


def p_validation(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    method = ctx.get("method")
    if method in ("sft", "rm") or (method == "dpo" and not has(rows, "val/rewards/accuracies")):
        return False  # only pair/loss metrics (the training figure draws them), no task score
    keys = sorted({k for r in rows for k in r if k.startswith("val/") and k not in ("val/reward", "val/loss")
                   and not k.startswith("val/reward/")  # val/reward/errors, /timeouts are counts
                   and k not in PAIR_METRICS})
    # One line per distinct series: with a single data source `val/accuracy` equals `val/<source>/accuracy`.
    drawn: dict[tuple, list[str]] = {}
    for key in keys:
        series = tuple((r.get("step"), r[key]) for r in rows if key in r)
        drawn.setdefault(series, []).append(key.removeprefix("val/"))
    ok = False
    for i, names in enumerate(list(drawn.values())[: len(CYCLE)]):
        ok |= line(ax, rows, "val/" + names[0], CYCLE[i], " = ".join(names), marker="o")
    finish(ax, "Validation metrics", "accuracy / score")
    return ok


def p_kl(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    ok = line(ax, rows, "kl/actor_ref", C["kl"], "kl/actor_ref (mean KL to ref)")
    ok |= line(ax, rows, "actor/ppo_kl", C["kl2"], "actor/ppo_kl (vs old policy)")
    ok |= line(ax, rows, "actor/kl_loss", C["kl3"], "actor/kl_loss")
    finish(ax, "KL divergence", "KL (nats/token)")
    return ok


def p_entropy(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    ok = line(ax, rows, "actor/entropy", C["entropy"], "actor/entropy")
    finish(ax, "Policy entropy", "nats/token", legend=False)
    return ok


def p_losses(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    ok = line(ax, rows, "actor/pg_loss", C["pg"], "actor/pg_loss")
    ok |= line(ax, rows, "critic/vf_loss", C["vf"], "critic/vf_loss")
    finish(ax, "Losses", "loss")
    return ok


# --------------------------------------------------------------------------------- supervised methods (SFT, RM, DPO)
TRAIN_LOSSES = ("sft/loss", "rm/loss", "dpo/loss")
# Preference accuracies (training, then validation) and the validation accuracies of SFT; in [0, 1], drawn in %.
ACCURACIES = ("rm/accuracy", "rewards/accuracies", "val/accuracy", "val/rewards/accuracies", "val/logp_accuracy",
              "val/token_accuracy")
MARGINS = ("rm/reward_margin", "rewards/margins", "val/reward_margin")
# Preference-pair statistics of RM/DPO validation: not task scores, so the RL validation panel leaves them out.
PAIR_METRICS = ("val/rewards/accuracies", "val/logp_accuracy", "val/reward_margin", "val/logps_chosen",
                "val/logps_rejected", "val/chosen_reward", "val/rejected_reward", "val/token_accuracy")


def p_train_loss(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    ok = False
    for i, key in enumerate(k for k in TRAIN_LOSSES if has(rows, k)):
        ok |= line(ax, rows, key, CYCLE[i], key)
    if ok:  # val/loss is the same objective on held-out data only when a training loss is drawn beside it
        line(ax, rows, "val/loss", C["val"], "val/loss", marker="o")
    finish(ax, "Training loss", "loss")
    return ok


def p_train_accuracy(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    if not has(rows, *TRAIN_LOSSES):
        return False
    ok = False
    for i, key in enumerate(k for k in ACCURACIES if has(rows, k)):
        ok |= line(ax, rows, key, CYCLE[i], key, marker="o" if key.startswith("val/") else None, scale=100.0)
    finish(ax, "Accuracy", "%")
    return ok


def p_margins(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    ok = False
    for i, key in enumerate(k for k in MARGINS if has(rows, k)):
        ok |= line(ax, rows, key, CYCLE[i], key, marker="o" if key.startswith("val/") else None)
    finish(ax, "Reward margin (chosen − rejected)", "reward")
    return ok


def p_grad(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    ok = line(ax, rows, "actor/grad_norm", C["grad"], "actor/grad_norm")
    ok |= line(ax, rows, "critic/grad_norm", C["grad2"], "critic/grad_norm")
    for i, key in enumerate(k for k in ("sft/grad_norm", "rm/grad_norm", "dpo/grad_norm") if has(rows, k)):
        ok |= line(ax, rows, key, CYCLE[2 + i], key)
    finish(ax, "Gradient norm (before clipping)", "L2 norm")
    return ok


def p_clipfrac(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    ok = line(ax, rows, "actor/pg_clipfrac", C["clip"], "actor/pg_clipfrac", scale=100.0)
    ok |= line(ax, rows, "actor/pg_clipfrac_lower", C["kl2"], "actor/pg_clipfrac_lower", scale=100.0)
    ok |= line(ax, rows, "critic/vf_clipfrac", C["vf"], "critic/vf_clipfrac", scale=100.0)
    finish(ax, "Clipped tokens", "% of tokens")
    return ok


def p_length(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    band(ax, rows, "response_length/min", "response_length/max", C["resp"], "response min–max")
    ok = line(ax, rows, "response_length/mean", C["resp"], "response length (mean)")
    ok |= line(ax, rows, "prompt_length/mean", C["prompt"], "prompt length (mean)", linestyle="--")
    finish(ax, "Sequence length", "tokens")
    return ok


def p_clip(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    x, y = series(rows, "response_length/clip_ratio", 100.0)
    if not len(x):
        return False
    ax.fill_between(x, y, color=C["clip"], alpha=0.10, linewidth=0)
    line(ax, rows, "response_length/clip_ratio", C["clip"], scale=100.0)
    ax.set_ylim(0, max(5.0, float(np.nanmax(y)) * 1.1))
    finish(ax, "Responses hitting max length", "% of responses", legend=False)
    return True


def stage_matrix(rows: Rows) -> tuple[np.ndarray, list[str], np.ndarray]:
    """(steps, stage names, seconds [stage, step]) with an `other` row = timing/step − Σ stages when positive."""
    trows = [r for r in rows if any(r.get(f"timing/{s}") is not None for s in STAGES)]
    names = [s for s in STAGES if has(trows, f"timing/{s}")]
    if not names:
        return np.zeros(0), [], np.zeros((0, 0))
    x = np.asarray([r["step"] for r in trows], dtype=float)
    m = np.asarray([[r.get(f"timing/{s}") or 0.0 for r in trows] for s in names], dtype=float).reshape(len(names), -1)
    if has(trows, "timing/step"):
        total = np.asarray([r.get("timing/step") or np.nan for r in trows], dtype=float)
        other = np.clip(np.nan_to_num(total - m.sum(axis=0), nan=0.0), 0, None)
        if other.sum() > 0:
            names.append("other")
            m = np.vstack([m, other])
    return x, names, m


def p_timing(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    x, names, m = stage_matrix(rows)
    if not names:
        return False
    colors = [STAGE_COLORS.get(n, C["other"]) for n in names]
    ax.stackplot(x, m, labels=names, colors=colors, alpha=0.9, linewidth=0)
    handles, labels = ax.get_legend_handles_labels()  # legend top-to-bottom in the same order as the stack
    ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=9)
    finish(ax, "Time per step by stage (stacked)", "seconds", legend=False)
    return True


def p_timing_share(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    _, names, m = stage_matrix(rows)
    if not names:
        return False
    mean = m.mean(axis=1)
    order = np.argsort(mean)
    share = mean / max(mean.sum(), 1e-12) * 100
    colors = [STAGE_COLORS.get(names[i], C["other"]) for i in order]
    ax.barh([names[i] for i in order], mean[order], color=colors)
    for pos, i in enumerate(order):
        ax.text(mean[i], pos, f"  {mean[i]:.2f}s · {share[i]:.0f}%", va="center", fontsize=9, color="#334155")
    ax.set_xlim(0, mean.max() * 1.35 if mean.max() > 0 else 1)
    ax.grid(axis="y", visible=False)
    ax.set_title("Mean time per stage", loc="left")
    ax.set_xlabel("seconds per step")
    return True


def p_throughput(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    ok = line(ax, rows, "perf/throughput", C["tput"], "perf/throughput")
    finish(ax, "Throughput", "tokens / s / GPU", legend=False)
    return ok


def p_mfu(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    ok = line(ax, rows, "actor/mfu", C["mfu"], "actor/mfu", scale=100.0)
    finish(ax, "Model FLOPs utilisation (actor)", "MFU (%)", legend=False)
    return ok


def p_memory(ax: Any, rows: Rows, ctx: dict[str, Any]) -> bool:
    ok = line(ax, rows, "perf/max_memory_allocated_gb", C["gpu"], "GPU max allocated", raw=True)
    ok |= line(ax, rows, "perf/cpu_memory_gb", C["cpu"], "CPU (host) memory", raw=True)
    limit = ctx.get("device_memory_gib")
    if ok and limit and has(rows, "perf/max_memory_allocated_gb"):
        ax.axhline(limit, color=C["gpu"], linestyle=":", linewidth=1.2, label=f"device limit {limit:.0f} GiB")
    finish(ax, "Memory", "GiB")
    return ok


FIGURES: tuple[FigureSpec, ...] = (
    FigureSpec("training", "Training loss and accuracy", (p_train_loss, p_train_accuracy, p_margins)),
    FigureSpec("reward", "Reward and validation", (p_reward, p_validation)),
    FigureSpec("kl_entropy", "KL and entropy", (p_kl, p_entropy)),
    FigureSpec("losses", "Losses, gradients and clipping", (p_losses, p_grad, p_clipfrac)),
    FigureSpec("response_length", "Response length", (p_length, p_clip)),
    FigureSpec("timing", "Step time breakdown", (p_timing, p_timing_share)),
    FigureSpec("perf", "Throughput, MFU and memory", (p_throughput, p_mfu, p_memory)),
)


@contextlib.contextmanager
def report_style() -> Iterator[None]:
    """Apply STYLE; figures are plain `Figure` objects (no pyplot global state, no GUI backend needed)."""
    import matplotlib

    with matplotlib.rc_context(STYLE):
        yield


def draw(spec: FigureSpec, rows: Rows, ctx: dict[str, Any]) -> Any | None:
    """The figure for `spec`, with only the panels that have data; None when none has. Call inside report_style()."""
    from matplotlib.figure import Figure

    # probe each panel on a scratch axes so a panel without data leaves no empty box
    active = [panel for panel in spec.panels if panel(Figure().add_subplot(), rows, ctx)]
    if not active:
        return None
    fig = Figure(figsize=(FIG_W if len(active) > 1 else FIG_W * 0.62, FIG_H), layout="constrained")
    axes = fig.subplots(1, len(active), squeeze=False)
    for panel, ax in zip(active, axes[0]):
        panel(ax, rows, ctx)
    return fig


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
