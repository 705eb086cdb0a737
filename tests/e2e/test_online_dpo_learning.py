"""Online DPO learns the arithmetic task from the committed SFT checkpoint (`tests/assets/sft_arithmetic`, 17.6%
greedy accuracy: it prefers "answer + 1"): 4 sampled responses per prompt, ranked by the task's rule reward, the DPO
loss on each prompt's best/worst pair, 10 steps; greedy validation accuracy on 256 held-out problems before and
after. The default numerics here, the AVX2 emulation in a child process (the ISA switches are read when torch loads).

Margins: below the minimum over 5 RL seeds x {default, AVX2} (docs/benchmarks.md, "Online DPO").
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from hybridflow.commands.quickstart import QUICKSTART_YAML
from hybridflow.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SFT_CHECKPOINT = ROOT / "tests" / "assets" / "sft_arithmetic"
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
MIN_GAIN = 0.70  # min measured +0.816 (5 RL seeds x {default, AVX2}: 17.6% -> 99.2-100%)


def online_dpo_from_checkpoint(tmp: Path, *overrides: str) -> dict[str, list[float]]:
    """Validation accuracies (step 0, then every `trainer.test_freq`), step losses and tied-group counts of an online
    DPO run from the committed SFT checkpoint on the quickstart's task and model."""
    from hybridflow.trainer.online_dpo import run_online_dpo

    cfg = load_config([QUICKSTART_YAML], [
        f"trainer.run_dir={tmp}/run", f"trainer.default_local_dir={tmp}/ckpt", "trainer.logger=[]",
        "dpo.online=true", f"dpo.init_from={SFT_CHECKPOINT}", "rollout.n=4", "trainer.total_training_steps=10",
        *overrides])
    history = run_online_dpo(cfg)
    return {"acc": [m["val/accuracy"] for m in history if "val/accuracy" in m],
            "loss": [m["actor/loss"] for m in history if "actor/loss" in m],
            "tied": [m["online_dpo/tied_groups"] for m in history if "online_dpo/tied_groups" in m],
            "pairs": [m["online_dpo/pairs"] for m in history if "online_dpo/pairs" in m]}


def _assert_learns(run: dict[str, list[float]], label: str) -> None:
    acc = run["acc"]
    assert len(acc) >= 2, f"{label}: no validation after step 0: {run}"
    assert acc[-1] - acc[0] >= MIN_GAIN, (f"online DPO ({label}) from {SFT_CHECKPOINT.name}: validation accuracy "
                                          f"{[round(a, 3) for a in acc]} rose {acc[-1] - acc[0]:+.3f}, needs >= "
                                          f"{MIN_GAIN}; losses {[round(x, 3) for x in run['loss']]}")


def test_online_dpo_raises_accuracy_from_sft_checkpoint(tmp_path: Path) -> None:
    run = online_dpo_from_checkpoint(tmp_path)
    assert abs(run["loss"][0] - math.log(2)) < 1e-6, run  # step 1: the policy is the reference
    assert all(p + t == 32 for p, t in zip(run["pairs"], run["tied"])), run  # every prompt paired or counted tied
    _assert_learns(run, "default numerics")


def test_online_dpo_learns_under_avx2_numerics(tmp_path: Path) -> None:
    code = ("import importlib.util, json, sys; from pathlib import Path;"
            "spec = importlib.util.spec_from_file_location('odpo', sys.argv[2]);"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m);"
            "print(json.dumps(m.online_dpo_from_checkpoint(Path(sys.argv[1]), *sys.argv[3:])))")
    env = {**os.environ, **AVX2, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path), __file__], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"online DPO under AVX2 emulation failed:\n{proc.stderr[-3000:]}"
    _assert_learns(json.loads(proc.stdout.strip().splitlines()[-1]), "AVX2 emulation")
