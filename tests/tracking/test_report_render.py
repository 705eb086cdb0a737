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
    assert [n for n, _ in IMG.findall(html)] == ["losses"]


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
    assert "correct = scorer's acc, else score ≥ 0.5 (reward.success_threshold)" in cards["val accuracy"]
