"""`hybridflow report`: a self-contained HTML page (PNG plots embedded as base64) drawn from a run directory.

Reads metrics.jsonl, events.jsonl, config.yaml and versions.json — all optional except metrics — so it works on a
finished run, on a run still writing (torn last line skipped) and on a run from another machine. No network, no
external CSS/JS: the file can be mailed or attached to an issue.
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import io
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.tracking import plots
from hybridflow.tracking.base import flatten
from hybridflow.tracking.jsonl import METRICS_FILE, read_events, read_metrics
from hybridflow.tracking.run_info import CONFIG_FILE, VERSIONS_FILE
from hybridflow.tracking.summary import TOTAL_STEPS, method_of, metric_meaning, summary_metrics

logger = logging.getLogger(__name__)

CONFIG_SUMMARY_KEYS = (
    "model.path", "model.preset", "algorithm.adv_estimator", "actor.policy_loss", "data.task", "data.train_files",
    "data.train_batch_size", "rollout.n", "actor.ppo_mini_batch_size", "actor.ppo_epochs", "actor.optim.lr",
    "actor.use_kl_loss", "algorithm.use_kl_in_reward", "data.max_prompt_length", "data.max_response_length",
    "rollout.temperature", "trainer.total_epochs", "trainer.total_training_steps", "trainer.nnodes",
    "trainer.n_gpus_per_node", "trainer.device", "trainer.logger", "trainer.seed",
)
PNG_DPI = 110
WIDE_DETAIL = 60  # a card whose detail is longer spans two grid columns (and wraps anywhere: never cut)


@dataclass
class RunData:
    run_dir: Path
    rows: list[dict[str, Any]]
    events: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)


def load_run(run_dir: str | Path) -> RunData:
    run_dir = Path(run_dir)
    if not (run_dir / METRICS_FILE).exists():
        raise ValueError(f"{run_dir} has no {METRICS_FILE}; pass a run directory (trainer.run_dir of a run), "
                         f"e.g. runs/<project>/<experiment>")
    config: dict[str, Any] = {}
    if (run_dir / CONFIG_FILE).exists():
        import yaml

        config = yaml.safe_load((run_dir / CONFIG_FILE).read_text(encoding="utf-8")) or {}
    versions = {}
    if (run_dir / VERSIONS_FILE).exists():
        versions = json.loads((run_dir / VERSIONS_FILE).read_text(encoding="utf-8"))
    return RunData(run_dir, read_metrics(run_dir), read_events(run_dir), config, versions)


# --------------------------------------------------------------------------------------------------- figures
def figure_context(run: RunData) -> dict[str, Any]:
    gib = run.versions.get("device", {}).get("gpu_memory_gib") or []
    return {"warnings": [e for e in run.events if e.get("level") in ("warning", "error")],
            "device_memory_gib": gib[0] if gib else None, "method": method_of(run.rows)}


def render_figures(run: RunData) -> list[tuple[plots.FigureSpec, bytes]]:
    """(spec, PNG bytes) for every figure that has data."""
    out = []
    ctx = figure_context(run)
    with plots.report_style():
        for spec in plots.FIGURES:
            fig = plots.draw(spec, run.rows, ctx)
            if fig is None:
                continue
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=PNG_DPI)
            out.append((spec, buf.getvalue()))
    return out


# --------------------------------------------------------------------------------------------------- summary
def _values(rows: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in rows if r.get(key) is not None]


def headline_cards(run: RunData) -> list[tuple[str, str, str]]:
    """(label, value, detail) for the header cards; only metrics that exist. Validation cards are labelled by the
    metric's name and say what it counts (`summary.metric_meaning`: `val/accuracy` differs between methods)."""
    rows, cards = run.rows, []
    method = method_of(rows)
    rew = _values(rows, "reward/score/mean")
    if rew:
        cards.append(("train reward", f"{rew[-1]:.3f}", f"first {rew[0]:.3f} · best {max(rew):.3f}"))
    for label, key in (("SFT loss", "sft/loss"), ("RM loss", "rm/loss"), ("DPO loss", "dpo/loss")):
        loss = _values(rows, key)
        if loss:
            cards.append((label, f"{loss[-1]:.4g}", f"first {loss[0]:.4g} · min {min(loss):.4g}"))
    for spec in summary_metrics(method, rows):
        val = _values(rows, spec.key)
        pct = spec.kind == "accuracy"
        fmt = (lambda v: f"{100 * v:.1f}%") if pct else (lambda v: f"{v:.4g}")
        best = min(val) if spec.kind == "loss" else max(val)
        detail = (f"first {fmt(val[0])} · {'min' if spec.kind == 'loss' else 'best'} {fmt(best)} · "
                  f"{metric_meaning(spec.key, method, rows, run.config)}")
        cards.append((spec.key, fmt(val[-1]), detail))
    for label, key, fmt, detail in (("step time", "timing/step", "{:.2f}s", "median over steps"),
                                    ("throughput", "perf/throughput", "{:,.0f}", "tokens/s/GPU, median"),
                                    ("MFU (actor)", "actor/mfu", "{:.1%}", "median over steps")):
        v = _values(rows, key)
        if v:
            cards.append((label, fmt.format(statistics.median(v)), detail))
    mem = _values(rows, "perf/max_memory_allocated_gb")
    if mem:
        cards.append(("peak GPU memory", f"{max(mem):.1f} GiB", "max allocated"))
    warns = [e for e in run.events if e.get("level") in ("warning", "error")]
    cards.append(("health warnings", str(len(warns)), ", ".join(sorted({str(e.get("kind")) for e in warns})) or "none"))
    return cards


def total_steps(run: RunData) -> int | None:
    """The run's own step count: what the tracker logged (`training/total_steps`), else the method's config key."""
    logged = _values(run.rows, TOTAL_STEPS)
    if logged:
        return int(logged[-1])
    method = method_of(run.rows)
    section = method if method in ("sft", "rm", "dpo") else "trainer"
    key = "total_steps" if section != "trainer" else "total_training_steps"
    value = (run.config.get(section) or {}).get(key)
    return int(value) if isinstance(value, int | float) else None


def run_status(run: RunData) -> tuple[str, str]:
    """(status, css class) from the last run_start/run_end event, else from how recently metrics were written."""
    marks = [e for e in run.events if e.get("kind") in ("run_start", "run_end")]
    if marks and marks[-1]["kind"] == "run_end":
        status = str(marks[-1].get("status", "finished"))
        return status, "ok" if status == "finished" else "bad"
    last = max((r.get("time") or 0 for r in run.rows), default=0)
    idle = time.time() - last
    if idle < 600:
        return f"running · last update {_dur(idle)} ago", "run"
    return f"no end marker · last update {_dur(idle)} ago", "warn"


def _dur(seconds: float) -> str:
    s = int(max(0, seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m" if h else (f"{m}m {s:02d}s" if m else f"{s}s")


def _fmt_cfg(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, list):
        return ", ".join(map(str, v)) or "[]"
    return "null" if v is None else str(v)


# --------------------------------------------------------------------------------------------------- html
def render_html(run: RunData, figures: list[tuple[plots.FigureSpec, bytes]]) -> str:
    e = html.escape
    trainer = run.config.get("trainer", {})
    project = trainer.get("project_name") or run.run_dir.parent.name
    name = trainer.get("experiment_name") or run.run_dir.name
    steps = [r["step"] for r in run.rows]
    times = [r["time"] for r in run.rows if r.get("time")]
    total = total_steps(run)
    status, status_cls = run_status(run)
    start = dt.datetime.fromtimestamp(min(times)).strftime("%Y-%m-%d %H:%M") if times else "?"
    meta = [("steps", f"{max(steps) if steps else 0}" + (f" / {total}" if total else "")),
            ("duration", _dur(max(times) - min(times)) if times else "?"), ("started", start),
            ("run dir", str(run.run_dir))]
    parts = [_HEAD.format(title=e(f"{project}/{name} · hybridflow report"))]
    parts.append(f'<header><div class="proj">{e(project)}</div><h1>{e(name)} '
                 f'<span class="badge {status_cls}">{e(status)}</span></h1><div class="meta">')
    parts += [f"<span><b>{e(k)}</b> {e(v)}</span>" for k, v in meta]
    parts.append('</div></header><section class="cards">')
    parts += [f'<div class="card{" wide" if len(detail) > WIDE_DETAIL else ""}"><div class="label">{e(label)}</div>'
              f'<div class="value">{e(value)}</div><div class="detail">{e(detail)}</div></div>'
              for label, value, detail in headline_cards(run)]
    parts.append("</section>")
    if figures:
        parts.append('<nav>' + " ".join(f'<a href="#{s.name}">{e(s.title)}</a>' for s, _ in figures)
                     + '<a href="#events">Events</a><a href="#config">Config</a></nav>')
    for spec, png in figures:
        b64 = base64.b64encode(png).decode("ascii")
        parts.append(f'<section class="fig" id="{spec.name}"><h2>{e(spec.title)}</h2>'
                     f'<img alt="{e(spec.title)}" src="data:image/png;base64,{b64}"></section>')
    if not figures:
        parts.append('<section><p class="empty">No plottable metrics yet.</p></section>')
    parts.append(_events_html(run.events))
    parts.append(_config_html(run))
    parts.append(f'<footer>generated {dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")} by '
                 f'<code>hybridflow report</code> from {e(str(run.run_dir / METRICS_FILE))} '
                 f'({len(run.rows)} steps)</footer></main></body></html>')
    return "\n".join(parts)


def _events_html(events: list[dict[str, Any]]) -> str:
    e = html.escape
    out = ['<section id="events"><h2>Events</h2>']
    if not events:
        out.append('<p class="empty">No events recorded.</p></section>')
        return "".join(out)
    t0 = min(ev.get("time") or 0 for ev in events)
    out.append('<div class="scroll"><table class="events"><thead><tr><th>step</th><th>time</th><th>level</th>'
               '<th>kind</th><th>message</th></tr></thead><tbody>')
    for ev in events:
        level = str(ev.get("level", "info"))
        out.append(f'<tr class="{e(level)}"><td>{e(str(ev.get("step", "")))}</td>'
                   f'<td>+{_dur((ev.get("time") or t0) - t0)}</td><td><span class="lvl {e(level)}">{e(level)}</span></td>'
                   f'<td>{e(str(ev.get("kind", "")))}</td><td>{e(str(ev.get("message", "")))}</td></tr>')
    out.append("</tbody></table></div></section>")
    return "".join(out)


def _config_html(run: RunData) -> str:
    e = html.escape
    out = ['<section id="config"><h2>Run configuration</h2><div class="two">']
    flat = flatten(run.config)
    rows = [(k, flat[k]) for k in CONFIG_SUMMARY_KEYS if k in flat]
    out.append('<table class="kv"><caption>key settings</caption>'
               + "".join(f"<tr><th>{e(k)}</th><td>{e(_fmt_cfg(v))}</td></tr>" for k, v in rows)
               + ("" if rows else '<tr><td class="empty">no config.yaml in the run directory</td></tr>') + "</table>")
    v = run.versions
    if v:
        pk = v.get("packages", {})
        dev = v.get("device", {})
        gpus = dev.get("gpus") or []
        device = f"{len(gpus)}× {gpus[0]}" if gpus else f"CPU ({dev.get('cpu_count', '?')} cores)"
        vrows = [("python", v.get("python")), *[(n, pk.get(n)) for n in ("torch", "transformers", "ray", "hybridflow")],
                 ("CUDA", dev.get("cuda")), ("device", device), ("host", v.get("hostname")),
                 ("git commit", v.get("git_commit"))]
        out.append('<table class="kv"><caption>environment</caption>'
                   + "".join(f"<tr><th>{e(k)}</th><td>{e(_fmt_cfg(val))}</td></tr>" for k, val in vrows) + "</table>")
    out.append("</div>")
    if run.config:
        import yaml

        text = yaml.safe_dump(run.config, sort_keys=False, default_flow_style=False, width=110)
        out.append(f"<details><summary>full resolved config</summary><pre>{e(text)}</pre></details>")
    out.append("</section>")
    return "".join(out)


def render_report(run_dir: str | Path, out: str | Path | None = None, png_dir: str | Path | None = None) -> Path:
    """Write the HTML report (default run_dir/report.html) and, with `png_dir`, one PNG per figure."""
    run = load_run(run_dir)
    figures = render_figures(run)
    out_path = Path(out) if out is not None else run.run_dir / "report.html"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(render_html(run, figures), encoding="utf-8")
    if png_dir is not None:
        png_dir = Path(png_dir)
        png_dir.mkdir(parents=True, exist_ok=True)
        for spec, png in figures:
            (png_dir / f"{plots.safe_name(spec.name)}.png").write_bytes(png)
    logger.info("report: %d figures, %d steps → %s", len(figures), len(run.rows), out_path)
    return out_path


_HEAD = """<!doctype html><html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>{title}</title><style>
:root {{ --fg:#0f172a; --muted:#64748b; --line:#e2e8f0; --bg:#f8fafc; --accent:#2563eb; }}
* {{ box-sizing:border-box; }}
body {{ margin:0; background:var(--bg); color:var(--fg);
  font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif; }}
main {{ max-width:1260px; margin:0 auto; padding:28px 28px 40px; }}
header {{ border-bottom:1px solid var(--line); padding-bottom:14px; margin-bottom:18px; }}
.proj {{ color:var(--muted); font-size:13px; text-transform:uppercase; letter-spacing:.06em; }}
h1 {{ margin:2px 0 8px; font-size:28px; font-weight:650; }}
h2 {{ font-size:18px; font-weight:620; margin:0 0 10px; }}
.meta span {{ margin-right:22px; color:#334155; font-size:14px; }} .meta b {{ color:var(--muted); font-weight:500; }}
.badge {{ font-size:12.5px; font-weight:600; padding:3px 10px; border-radius:999px; vertical-align:middle; }}
.badge.ok {{ background:#dcfce7; color:#166534; }} .badge.run {{ background:#dbeafe; color:#1e40af; }}
.badge.warn {{ background:#fef3c7; color:#92400e; }} .badge.bad {{ background:#fee2e2; color:#991b1b; }}
.cards {{ display:grid; grid-template-columns:repeat(auto-fill,minmax(150px,1fr)); gap:12px; margin-bottom:18px; }}
.card {{ background:#fff; border:1px solid var(--line); border-radius:10px; padding:12px 14px; min-width:0; }}
.card.wide {{ grid-column:span 2; }}
.card .label {{ color:var(--muted); font-size:12.5px; letter-spacing:.04em; overflow-wrap:anywhere; }}
.card .value {{ font-size:24px; font-weight:650; margin:2px 0; font-variant-numeric:tabular-nums; }}
.card .detail {{ color:var(--muted); font-size:12.5px; overflow-wrap:anywhere; white-space:normal; }}
nav {{ margin:0 0 14px; }} nav a {{ display:inline-block; margin:0 6px 6px 0; padding:3px 10px; background:#fff;
  border:1px solid var(--line); border-radius:999px; color:var(--accent); text-decoration:none; font-size:13px; }}
section {{ background:#fff; border:1px solid var(--line); border-radius:12px; padding:16px 18px; margin-bottom:16px; }}
section.cards {{ background:none; border:0; padding:0; }}
section.fig img {{ display:block; max-width:100%; height:auto; margin:0 auto; }}
table {{ border-collapse:collapse; width:100%; font-size:14px; }}
th, td {{ text-align:left; padding:6px 10px; border-bottom:1px solid var(--line); vertical-align:top; }}
thead th {{ position:sticky; top:0; background:#f1f5f9; font-weight:600; }}
.scroll {{ max-height:420px; overflow:auto; border:1px solid var(--line); border-radius:8px; }}
table.events td:first-child, table.events td:nth-child(2) {{ white-space:nowrap; font-variant-numeric:tabular-nums; }}
.lvl {{ font-size:12px; font-weight:600; padding:1px 8px; border-radius:999px; background:#e2e8f0; }}
.lvl.warning {{ background:#fef3c7; color:#92400e; }} .lvl.error {{ background:#fee2e2; color:#991b1b; }}
.lvl.info {{ background:#e0f2fe; color:#075985; }}
.two {{ display:grid; grid-template-columns:1fr 1fr; gap:18px; align-items:start; }}
table.kv caption {{ text-align:left; font-weight:600; color:var(--muted); padding:0 0 6px; font-size:13px;
  text-transform:uppercase; letter-spacing:.04em; }}
table.kv th {{ width:46%; color:#334155; font-weight:500; font-family:ui-monospace,Menlo,Consolas,monospace;
  font-size:13px; }}
details {{ margin-top:14px; }} summary {{ cursor:pointer; color:var(--accent); }}
pre {{ background:#f8fafc; border:1px solid var(--line); border-radius:8px; padding:12px; font-size:12.5px;
  max-height:480px; overflow:auto; }}
.empty {{ color:var(--muted); }}
footer {{ color:var(--muted); font-size:12.5px; text-align:center; margin-top:8px; }}
</style></head><body><main>"""
