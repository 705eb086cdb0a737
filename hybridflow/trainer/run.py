"""Run a PPO/GRPO training from a config: tracker, trainer, fit, clean shutdown. Used by `hybridflow train`,
`hybridflow quickstart` and tests."""

from __future__ import annotations

from typing import Any

from hybridflow.config import Config


def versions_line() -> str:
    """python, torch, CUDA, transformers, ray, hybridflow and the device, on one line (the seed's advice)."""
    from hybridflow.tracking.run_info import collect_versions, summary

    return summary(collect_versions())


def run_ppo(cfg: Config, tracker: Any = None) -> list[dict[str, float]]:
    """Train with `cfg`; returns the per-step metrics. The tracker is built from `trainer.logger` when not given."""
    from hybridflow.trainer.ppo import PPOTrainer

    own_tracker = tracker is None
    if own_tracker:
        from hybridflow.tracking import Tracker

        tracker = Tracker.from_config(cfg)
    trainer = PPOTrainer(cfg, tracker=tracker)
    try:
        return trainer.fit()
    finally:
        trainer.close()
        if own_tracker:
            tracker.close()
