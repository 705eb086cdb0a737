"""Synthetic GRPO-like metric streams for the tracking tests (and for eyeballing the report)."""

from __future__ import annotations

import io
import math
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from hybridflow.tracking import HealthMonitor, build_tracker

HEALTH = SimpleNamespace(gen_time_warn_s=1.0, update_jitter_warn_s=0.1, jitter_window=5, val_drop_patience=3,
                         memory_warn_frac=0.95)


def synthetic_metrics(step: int, total: int, rng: random.Random, val_every: int = 10) -> dict[str, float]:
    """One step of plausible GRPO metrics. Includes a slow-generation stretch (steps 40-44), a jittery update
    stretch (60-69) and a validation reward that falls three times in a row (validations at 60, 70, 80)."""
    p = 1 / (1 + math.exp(-(step - total * 0.4) / (total * 0.12)))
    reward = 0.1 + 0.7 * p + rng.gauss(0, 0.04)
    resp = 18 + 10 * p + rng.gauss(0, 1.0)
    gen = 0.6 + rng.gauss(0, 0.03) + (0.9 if 40 <= step < 45 else 0.0)
    upd = 0.42 + rng.gauss(0, 0.01) + (rng.choice([0.0, 0.5]) if 60 <= step < 70 else 0.0)
    stages = {"gen": gen, "reward": 0.05, "old_log_prob": 0.12, "ref": 0.11, "adv": 0.01, "update_actor": upd,
              "switch": 0.04}
    m = {f"timing/{k}": max(0.0, v + rng.gauss(0, 0.003)) for k, v in stages.items()}
    m["timing/step"] = sum(m.values()) + 0.03
    m.update({
        "reward/score/mean": reward, "reward/score/max": min(1.0, reward + 0.2), "reward/score/min": max(0.0, reward - 0.3),
        "actor/pg_loss": rng.gauss(0, 0.02), "actor/entropy": 1.6 - 0.8 * p + rng.gauss(0, 0.03),
        "actor/ppo_kl": abs(rng.gauss(0.002, 0.001)), "actor/kl_loss": 0.01 * p + abs(rng.gauss(0, 0.002)),
        "kl/actor_ref": 0.02 * p + abs(rng.gauss(0, 0.003)), "actor/grad_norm": 0.8 + abs(rng.gauss(0, 0.2)),
        "actor/pg_clipfrac": abs(rng.gauss(0.02, 0.01)), "actor/lr": 1e-6,
        "response_length/mean": resp, "response_length/max": resp + 10, "response_length/min": max(1.0, resp - 12),
        "response_length/clip_ratio": max(0.0, 0.05 * p + rng.gauss(0, 0.01)), "prompt_length/mean": 22.0,
        "perf/throughput": 5200 + rng.gauss(0, 150), "actor/mfu": 0.31 + rng.gauss(0, 0.01),
        "perf/max_memory_allocated_gb": 61 + 3 * p, "perf/cpu_memory_gb": 12.5 + 0.01 * step,
        "training/global_step": float(step), "training/epoch": 0.0,
    })
    if 100 <= step < 104:
        m["perf/max_memory_allocated_gb"] = 77.0
    if step % val_every == 0:
        p_val = p if not 60 <= step <= 90 else 1 / (1 + math.exp(-(50 - total * 0.4) / (total * 0.12)))
        drop = 0.04 * (step - 50) / 10 if 60 <= step <= 90 else 0.0
        m["val/reward"] = 0.15 + 0.65 * p_val - drop
        m["val/arithmetic/accuracy"] = 0.12 + 0.7 * p_val - drop
        m["val/countdown/accuracy"] = 0.05 + 0.4 * p_val - drop / 2
    return m


def write_synthetic_run(run_dir: Path, steps: int = 120, seed: int = 0, finish: bool = True) -> Path:
    """A run directory written through the real Tracker (jsonl + health watermarks + run info)."""
    from hybridflow.config import load_config
    from hybridflow.tracking.run_info import write_run_info

    rng = random.Random(seed)
    cfg = load_config([], [f"trainer.total_training_steps={steps}", "trainer.experiment_name=synthetic-grpo"],
                      validate=False)
    write_run_info(run_dir, cfg)
    tracker = build_tracker(["console"], run_dir, experiment="synthetic-grpo", health=HealthMonitor(HEALTH, device_memory_gb=80.0),
                            console={"stream": io.StringIO(), "tty": False})
    tracker.event("run_start", "synthetic run", step=0)
    for step in range(1, steps + 1):
        tracker.log(synthetic_metrics(step, steps, rng), step)
    if finish:
        tracker.close()
    return run_dir


@pytest.fixture(scope="session")
def synthetic_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_run(tmp_path_factory.mktemp("synthetic_run"))
