"""`hybridflow report`: HTML with decodable, non-blank embedded PNGs from a recorded run; partial runs too."""

from __future__ import annotations

import base64
import io
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hybridflow.cli import main
from hybridflow.tracking.plots import stage_matrix
from hybridflow.tracking.report import load_run, render_report

IMG = re.compile(r'<section class="fig" id="([a-z_]+)"><h2>[^<]*</h2><img alt="[^"]*" src="data:image/png;base64,([^"]+)"')
EXPECTED = ["reward", "kl_entropy", "losses", "response_length", "timing", "perf"]


def decode(b64: str) -> np.ndarray:
    img = Image.open(io.BytesIO(base64.b64decode(b64)))
    img.load()
    return np.asarray(img.convert("L"), dtype=float)


@pytest.fixture(scope="module")
def cli_report(synthetic_run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """`hybridflow report RUN --png DIR` once for the module (rendering is the slow part)."""
    base = tmp_path_factory.mktemp("cli_report")
    run = base / "run"
    shutil.copytree(synthetic_run, run)
    assert main(["report", str(run), "--png", str(base / "png")]) == 0
    return run / "report.html", base / "png"


def test_report_html_has_expected_plots(cli_report: tuple[Path, Path]) -> None:
    html = cli_report[0].read_text()
    figs = IMG.findall(html)
    assert [name for name, _ in figs] == EXPECTED
    for name, b64 in figs:
        px = decode(b64)
        assert px.shape[0] > 300 and px.shape[1] > 600, (name, px.shape)
        assert px.std() > 10 and (px < 128).mean() > 0.005, f"{name} looks blank"  # has dark ink, not a flat image
    assert "synthetic-grpo" in html and "finished" in html and "120 / 120" in html
    for kind in ("gen_time", "update_jitter", "val_drop", "memory"):  # health events table
        assert f"<td>{kind}</td>" in html
    assert "algorithm.adv_estimator" in html and "grpo" in html  # config summary
    assert "http://" not in html.replace("http://www.w3.org", "") and "<script" not in html  # self-contained


def test_cli_writes_pngs(cli_report: tuple[Path, Path]) -> None:
    html_path, png_dir = cli_report
    assert html_path.exists()
    assert sorted(p.stem for p in png_dir.glob("*.png")) == sorted(EXPECTED)
    embedded = dict(IMG.findall(html_path.read_text()))
    for name in EXPECTED:  # the single images are the same pictures as the embedded ones
        assert base64.b64decode(embedded[name]) == (png_dir / f"{name}.png").read_bytes()


def test_running_run_with_torn_line(synthetic_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    lines = (synthetic_run / "metrics.jsonl").read_text().splitlines()[:30]
    (run / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 31, "reward/sc')
    html = render_report(run).read_text()
    assert "running" in html and "<b>steps</b> 30" in html
    assert [n for n, _ in IMG.findall(html)] == EXPECTED  # config/versions/events files are optional


def test_sparse_run_drops_empty_panels(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "dpo/loss": {3 / s}}}\n' for s in range(1, 6)))
    html = render_report(tmp_path).read_text()
    assert [n for n, _ in IMG.findall(html)] == ["training"]


def test_missing_metrics_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_stage_matrix_other_is_the_remainder(synthetic_run: Path) -> None:
    run = load_run(synthetic_run)
    x, names, m = stage_matrix(run.rows)
    assert names[-1] == "other" and len(x) == len(run.rows)
    total = np.array([r["timing/step"] for r in run.rows])
    np.testing.assert_allclose(m.sum(axis=0), total, rtol=1e-9)


def test_headline_says_what_val_accuracy_counts(tmp_path: Path) -> None:
    from hybridflow.tracking.report import RunData, headline_cards

    rows = [{"reward/score/mean": 0.6, "val/reward": 0.9, "val/accuracy": 0.1}]
    cards = {label: detail for label, _, detail in headline_cards(
        RunData(tmp_path, rows, config={"reward": {"success_threshold": 0.5}}))}
    assert "correct = the scorer's acc, else score ≥ 0.5 (reward.success_threshold)" in cards["val/accuracy"]
    assert "greedy" in cards["val/accuracy"]


# ------------------------------------------------------------------------------- supervised runs (SFT, RM, DPO)
def _write_run(run_dir: Path, rows: list[dict], config: dict | None = None) -> Path:
    import json

    import yaml

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if config is not None:
        (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return run_dir


def _sft_rows(steps: int, total: int | None) -> list[dict]:
    rows = [{"step": 0, "val/loss": 4.6, "val/token_accuracy": 0.01}]
    for s in range(1, steps + 1):
        row = {"step": s, "sft/loss": 4.6 - 0.01 * s, "sft/grad_norm": 1.0, "timing/step": 0.1}
        if total is not None:
            row["training/total_steps"] = total
        if s % 2 == 0:
            row |= {"val/loss": 4.6 - 0.01 * s, "val/token_accuracy": 0.01 * s}
        rows.append(row)
    return rows


def test_sft_report_header_counts_its_own_steps(tmp_path: Path) -> None:
    """The header's total is the SFT run's step count, not `trainer.total_training_steps` (the RL phase's)."""
    config = {"trainer": {"total_training_steps": 30}, "sft": {"total_steps": 8}}
    logged = render_report(_write_run(tmp_path / "logged", _sft_rows(6, total=6), config)).read_text()
    assert "<b>steps</b> 6 / 6<" in logged and "/ 30" not in logged
    old = render_report(_write_run(tmp_path / "old", _sft_rows(6, total=None), config)).read_text()  # no total logged
    assert "<b>steps</b> 6 / 8<" in old and "/ 30" not in old


def test_supervised_reports_draw_loss_and_accuracy_curves(tmp_path: Path) -> None:
    html = render_report(_write_run(tmp_path / "sft", _sft_rows(6, total=6))).read_text()
    figs = dict(IMG.findall(html))
    assert list(figs)[0] == "training" and "reward" not in figs  # val/token_accuracy is drawn once, here
    rm_rows = [{"step": s, "rm/loss": 0.7 - 0.01 * s, "rm/accuracy": 0.5 + 0.02 * s, "rm/reward_margin": 0.1 * s,
                "val/loss": 0.69, "val/accuracy": 0.5 + 0.01 * s} for s in range(6)]
    figs = dict(IMG.findall(render_report(_write_run(tmp_path / "rm", rm_rows)).read_text()))
    assert "training" in figs and decode(figs["training"]).std() > 10


def _cards(run_dir: Path) -> dict[str, str]:
    from hybridflow.tracking.report import headline_cards

    return {label: detail for label, _, detail in headline_cards(load_run(run_dir))}


def test_dpo_accuracy_cards_say_which_accuracy(tmp_path: Path) -> None:
    """DPO's implicit-reward preference accuracy and a greedy task accuracy are told apart by the metric's name."""
    base = {"dpo/loss": 0.69, "rewards/accuracies": 0.6, "val/loss": 0.68}
    only_implicit = [{"step": s, **base, "val/accuracy": 0.5 + 0.1 * s} for s in range(3)]
    cards = _cards(_write_run(tmp_path / "old", only_implicit))
    assert "implicit-reward preference accuracy" in cards["val/accuracy"]
    both = [{"step": s, **base, "val/rewards/accuracies": 0.5 + 0.1 * s, "val/accuracy": 0.2 + 0.1 * s}
            for s in range(3)]
    cards = _cards(_write_run(tmp_path / "new", both))
    assert "implicit-reward preference accuracy" in cards["val/rewards/accuracies"]
    assert "task accuracy, greedy" in cards["val/accuracy"] and "implicit" not in cards["val/accuracy"]


def test_accuracy_card_text_is_whole_and_wraps(tmp_path: Path) -> None:
    """The rule under the accuracy card is all there, in a card that wraps its text (two columns wide)."""
    rows = [{"step": s, "reward/score/mean": 0.1 * s, "val/accuracy": 0.1 * s} for s in range(3)]
    html = render_report(_write_run(tmp_path / "run", rows, {"reward": {"success_threshold": 1.0}})).read_text()
    card = re.search(r'<div class="card([^"]*)"><div class="label">val/accuracy</div>.*?<div class="detail">([^<]*)<',
                     html)
    assert card is not None and card.group(1) == " wide"
    assert card.group(2).endswith("correct = the scorer&#x27;s acc, else score ≥ 1 (reward.success_threshold)")
    assert "overflow-wrap:anywhere" in html and "text-overflow" not in html and "nowrap" not in html.split(".card")[1]
