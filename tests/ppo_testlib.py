"""Shared by the PPO checkpoint/resume tests: a tiny CPU PPOTrainer config with a deterministic custom reward."""

from __future__ import annotations

from pathlib import Path

from hybridflow.config import load_config

REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
         "    return (sum(map(ord, solution_str)) % 5) / 4.0\n"


class SimulatedCrash(RuntimeError):
    """Raised inside a step to stand in for a process dying mid-run."""


def tiny_ppo_config(tmp_path: Path, ckpt_dir: Path, mini_batch: int, *extra: str):
    """1-layer tiny model, 16 train / 2 val prompts × 4 samples, local backend, no validation, checkpoints under
    `ckpt_dir`; `extra` overrides are applied last."""
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    return load_config(overrides=[
        "trainer.device=cpu", "trainer.backend=local", "model.override_config={num_hidden_layers: 1}",
        "data.train_size=16", "data.val_size=2", "data.max_response_length=6", "data.train_batch_size=2",
        "rollout.n=4", f"actor.ppo_mini_batch_size={mini_batch}", f"critic.ppo_mini_batch_size={mini_batch}",
        "actor.optim.lr=1e-3", "reward.sources=[{name: custom, weight: 1.0}]", f"reward.custom.path={reward}",
        "trainer.val_before_train=false", "trainer.test_freq=-1", f"trainer.default_local_dir={ckpt_dir}",
        *extra])


WALL_CLOCK = ("timing/", "perf/", "memory/", "tokens_per_s", "step_time_s", "throughput", "mfu")


def deterministic_metrics(metrics: dict) -> dict:
    """`metrics` without the wall-clock and memory readings (equal runs agree on everything else)."""
    return {k: v for k, v in metrics.items() if not any(s in k for s in WALL_CLOCK)}
