"""Health watermarks fire on synthetic unhealthy streams, once per episode, and stay quiet on healthy ones."""

from __future__ import annotations

import random
import statistics
from types import SimpleNamespace

import pytest

from hybridflow.tracking.health import HealthMonitor

CFG = SimpleNamespace(gen_time_warn_s=1.0, update_jitter_warn_s=0.1, jitter_window=5, val_drop_patience=3,
                      memory_warn_frac=0.95)


def run(monitor: HealthMonitor, stream: list[dict[str, float]]) -> list[tuple[int, str]]:
    return [(step, ev.kind) for step, m in enumerate(stream, start=1) for ev in monitor.check(m, step)]


def healthy_stream(n: int = 200, seed: int = 0) -> list[dict[str, float]]:
    rng = random.Random(seed)
    out, val = [], 0.2
    for step in range(1, n + 1):
        m = {"timing/gen": 0.6 + rng.gauss(0, 0.05), "timing/update_actor": 0.4 + rng.gauss(0, 0.02),
             "perf/max_memory_allocated_gb": 60 + rng.random()}
        if step % 10 == 0:
            val += 0.01 if step % 30 else -0.005  # an occasional single dip is not a trend
            m["val/reward"] = val
        out.append(m)
    return out


def test_healthy_stream_is_quiet() -> None:
    mon = HealthMonitor(CFG, device_memory_gb=80.0)
    assert run(mon, healthy_stream()) == []
    assert mon.metrics() == {"health/gen_time": 0.0, "health/update_jitter": 0.0, "health/val_drop": 0.0,
                             "health/memory": 0.0}


def test_gen_time_fires_once_per_episode_and_rearms() -> None:
    gens = [5.0] + [0.5] * 4 + [1.5] * 5 + [0.5] * 3 + [2.0] * 2  # step 1 is warm-up (ignored)
    mon = HealthMonitor(CFG)
    events = run(mon, [{"timing/gen": g} for g in gens])
    assert events == [(6, "gen_time"), (14, "gen_time")]
    assert mon.metrics()["health/gen_time"] == 2.0
    ev = HealthMonitor(CFG).check({"timing/gen": 0.1}, 1) + HealthMonitor(CFG).check({"timing/gen": 0.1}, 1)
    assert ev == []


def test_gen_time_message_has_hint() -> None:
    mon = HealthMonitor(CFG)
    mon.check({"timing/gen": 0.1}, 1)
    (ev,) = mon.check({"timing/gen": 3.0}, 2)
    assert "gen_time_warn_s" in ev.message and "data loading" in ev.message and "tokenizer" in ev.message
    assert ev.data == {"value": 3.0, "threshold": 1.0}


def test_update_jitter_matches_naive_std() -> None:
    rng = random.Random(1)
    times = [9.0] + [0.4 + rng.gauss(0, 0.01) for _ in range(10)] + [0.4, 0.9, 0.4, 0.9, 0.4, 0.9]
    mon = HealthMonitor(CFG)
    events = run(mon, [{"timing/update_actor": t} for t in times])
    steady = times[1:]  # warm-up step excluded
    first_bad = next(i for i in range(CFG.jitter_window, len(steady) + 1)
                     if statistics.pstdev(steady[i - CFG.jitter_window:i]) > CFG.update_jitter_warn_s)
    assert events == [(first_bad + 1, "update_jitter")]  # +1: steady[k] is step k+2, window end index is exclusive


def test_jitter_needs_full_window() -> None:
    mon = HealthMonitor(CFG)
    assert run(mon, [{"timing/update_actor": t} for t in (0.1, 0.1, 2.0, 0.1)]) == []


@pytest.mark.parametrize("patience", [1, 2, 3])
def test_val_drop_after_patience_falls(patience: int) -> None:
    cfg = SimpleNamespace(**{**vars(CFG), "val_drop_patience": patience})
    vals = [0.5, 0.6, 0.55, 0.5, 0.45, 0.4, 0.7, 0.65]
    mon = HealthMonitor(cfg)
    events = []
    for i, v in enumerate(vals):
        events += [(i, ev.kind, ev.data["value"]) for ev in mon.check({"val/reward": v, "timing/gen": 0.1}, i)]
    falls_start = 2  # 0.6 → 0.55 is the first fall
    expected = [(falls_start + patience - 1, "val_drop", vals[falls_start + patience - 1])]
    if patience == 1:
        expected.append((7, "val_drop", 0.65))  # re-armed by the rise to 0.7, then falls again
    assert events == expected


def test_val_drop_uses_rollback_metric_and_reset() -> None:
    mon = HealthMonitor(CFG, rollback_metric="val/gsm8k/accuracy")
    vals = [0.5, 0.4, 0.3, 0.2]
    assert run(mon, [{"val/reward": v} for v in vals]) == []
    assert [k for _, k in run(mon, [{"val/gsm8k/accuracy": v} for v in vals])] == ["val_drop"]
    mon.reset_val()
    assert run(mon, [{"val/gsm8k/accuracy": v} for v in (0.1, 0.05, 0.04)]) == []


def test_memory_near_limit() -> None:
    mon = HealthMonitor(CFG, device_memory_gb=80.0)
    mems = [70, 76.5, 77, 60, 79]
    assert run(mon, [{"perf/max_memory_allocated_gb": m} for m in mems]) == [(2, "memory"), (5, "memory")]
    # a per-step device size in the metrics (perf/device_memory_gb) overrides the detected one
    assert HealthMonitor(CFG, device_memory_gb=80.0).check(
        {"perf/max_memory_allocated_gb": 77.0, "perf/device_memory_gb": 141.0}, 1) == []


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="jitter_window"):
        HealthMonitor(SimpleNamespace(**{**vars(CFG), "jitter_window": 1}))


def test_a_fall_after_a_nan_is_measured_against_the_last_number() -> None:
    """0.8 → NaN → 0.5: two falls (the NaN, then 0.5 below 0.8), not a recovery after the NaN."""
    cfg = SimpleNamespace(**{**vars(CFG), "val_drop_patience": 2})
    mon = HealthMonitor(cfg)
    kinds = [[ev.kind for ev in mon.check({"val/reward": v, "timing/gen": 0.1}, i)]
             for i, v in enumerate([0.8, float("nan"), 0.5])]
    assert kinds[2] == ["val_drop"]


def test_rollback_never_targets_a_checkpoint_scored_nan() -> None:
    from hybridflow.checkpoint.recovery import RollbackTracker

    tracker = RollbackTracker()
    for step, value in ((10, 0.8), (20, float("nan")), (30, float("nan"))):
        tracker.observe({"val/reward": value})
        tracker.on_checkpoint(step)
    assert tracker.best_step == 10
