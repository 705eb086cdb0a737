"""Learning, tested by stage so a failure names the stage (issue 19).

1. SFT: the quickstart's warm-start recipe (its data, label noise, optimizer, lr, warm-up, weight decay) on a 400-step
   cosine schedule instead of the quickstart's 1500 steps leaves the start's plateau (bound set from 5 seeds x 2
   numerics at 400 steps), and its gate (`sft.target_val_loss`) warns exactly when it is missed.
2. RL from the committed SFT checkpoint `tests/assets/sft_arithmetic` (regenerate: tests/assets/make_sft_checkpoint.py):
   GRPO and PPO with a critic raise greedy validation accuracy on held-out problems by a margin set below the minimum
   over 5 seeds × 2 CPU numerics settings (docs/benchmarks.md, "Learning tests by stage"); so does GRPO training
   LoRA adapters only (issue 24: rank 8, 10× the full fine-tuning lr, 10 steps), and so do the CISPO and SAPO
   policy losses with 4 mini-batches per step (off-policy updates, where they differ from PPO's clip).
3. The same GRPO run under an AVX2-only emulation (other kernels, other rounding), in a child process.
The Mixture-of-Experts model (`tiny-moe` preset at the quickstart's shape: Qwen3-MoE, 8 experts, top-2) has its own
stage 1 (SFT from scratch) and stage 2 (GRPO with routing replay from `tests/assets/sft_arithmetic_moe`).
Every failure message prints the trajectory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.commands.quickstart import QUICKSTART_YAML
from hybridflow.config import load_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SFT_CHECKPOINT = ROOT / "tests" / "assets" / "sft_arithmetic"
MOE_CHECKPOINT = ROOT / "tests" / "assets" / "sft_arithmetic_moe"
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
# RL steps from the checkpoint. Minimum validation-accuracy gains (points / 100), each below the minimum seen over 5 RL
# seeds x 2 numerics from the committed checkpoint at RL_STEPS (docs/benchmarks.md, "RL stage tests at 10 steps"):
# GRPO 81.6 / 82.4 / 82.4 points (min / median / max), PPO with a critic 81.2 / 81.2 / 81.6 — 17.6% → 99-100% (at the
# former 20 steps: 80.9 / 81.6 / 81.6 and 79.7 / 80.9 / 81.6, "Learning tests by stage").
RL_STEPS = 10
GRPO_MIN_GAIN = 0.70
PPO_MIN_GAIN = 0.65
# The SFT stage: the quickstart's SFT recipe on a SFT_STEPS cosine schedule (the quickstart itself runs 1500 steps, 4 min
# of `make test`). The val/loss falls from ~4.6 to a plateau near 0.6 by step 50 (the answer format, not yet the digits)
# and leaves it by step 250-300. Over 5 seeds x 2 numerics at 400 steps the final val/loss was 0.210 / 0.307 / 0.391
# (min / median / max; docs/benchmarks.md, "SFT stage test at 400 steps"): the bound is above the worst run and well
# below the plateau, so a recipe that stops learning, or learns only the format, fails. The extra schedule after a
# missed gate (sft.extra_schedules, 500 more steps) is off here; tests/trainer/test_sft.py covers it.
SFT_STEPS = 400
SFT_MAX_VAL_LOSS = 0.45
# trainer.mode=one_step_off (issue 27), same task and checkpoint, 5 seeds x 2 numerics at RL_STEPS: 78.5 / 78.9 / 80.5
# (min / median / max; docs/benchmarks.md, "RL stage tests at 10 steps"; at 20 steps and the sync comparison:
# "Asynchronous modes: learning").
ONE_STEP_OFF_MIN_GAIN = 0.70
# LoRA GRPO (issue 24): rank 8, alpha 16 on every decoder Linear, lr 1e-3 (10x the full-parameter 1e-4; 1e-4 with
# LoRA: see docs/benchmarks.md), 10 steps. Over 5 seeds x 2 numerics the gain was 76.2 / 80.1 / 81.2 points
# (min / median / max; 17.6% -> 93.8-98.8%).
LORA_GRPO = ("model.lora.rank=8", "model.lora.alpha=16", "actor.optim.lr=1e-3", "trainer.total_training_steps=10")
LORA_GRPO_MIN_GAIN = 0.65
# CISPO and SAPO (actor.policy_loss) differ from PPO's clip only off-policy: 4 optimizer steps per generation batch
# (mini-batches of 8 of the 32 prompts; the other stage-2 tests take one, strictly on-policy), so 3 of 4 updates see
# ratios != 1. In that setting, over 5 RL seeds x 2 numerics at RL_STEPS, the gain was CISPO +82.0 / +82.0 / +82.4 and
# SAPO +81.6 / +82.0 / +82.4 points (min / median / max) against GRPO's PPO clip +81.6 / +82.0 / +82.4, all 17.6% ->
# 99-100% (docs/benchmarks.md, "CISPO and SAPO"). Both are ~5 points behind GRPO at step 5 (medians +77.3 vs +82.0;
# minimum +71.5), so the test does not stop earlier.
OFF_POLICY = ("actor.ppo_mini_batch_size=8",)
POLICY_LOSS_MIN_GAIN = {"cispo": 0.70, "sapo": 0.70}
# MoE (docs/benchmarks.md, "MoE learning tests"): the `tiny-moe` SFT stage at SFT_STEPS ended at val/loss
# 0.180 / 0.254 / 0.322 (min / median / max, 5 seeds x 2 numerics); the same bound as the dense model's.
# GRPO with routing replay from the committed checkpoint (4.7% greedy: more off-by-one than the dense one) gained at
# MOE_RL_STEPS +48.4 / +50.8 / +51.2 points over 5 seeds, default and AVX2 numerics alike (identical trajectories);
# at 10 steps +87.9 / +89.5 / +90.6.
MOE_SFT_MAX_VAL_LOSS = 0.45
MOE_RL_STEPS = 5
MOE_GRPO_MIN_GAIN = 0.40
MOE_MIN_AGREEMENT = 0.99
# TIS (weight min(old/rollout ratio, 2), ~1 here) forces the old-log-prob pass, which reports moe/routing_agreement and
# moe/logprob_gap; the quickstart's single mini-batch would skip it
MOE_REPLAY = ("actor.moe.routing_replay=true", "algorithm.rollout_is.mode=tis")
PPO_OVERRIDES = ("algorithm.adv_estimator=gae", "algorithm.lam=0.95", "critic.optim.lr=1e-3",
                 "critic.ppo_mini_batch_size=32", "critic.ppo_micro_batch_size_per_gpu=256", "critic.warmup_steps=3")


def _cfg(tmp: Path, *overrides: str):
    return load_config([QUICKSTART_YAML], [f"trainer.run_dir={tmp}/run", f"trainer.default_local_dir={tmp}/ckpt",
                                           "trainer.logger=[jsonl]", *overrides])


def rl_history(tmp: Path, *overrides: str, checkpoint: Path = SFT_CHECKPOINT) -> list[dict[str, float]]:
    """The metrics of the quickstart's RL phase from a committed SFT checkpoint, one dict per step."""
    from hybridflow.trainer.run import run_ppo

    # RL_STEPS: the margins above were re-measured at 10 (the quickstart itself runs 30); LORA_GRPO sets its own
    return run_ppo(_cfg(tmp, f"model.path={checkpoint}", f"trainer.total_training_steps={RL_STEPS}", *overrides))


def rl_from_checkpoint(tmp: Path, *overrides: str) -> list[float]:
    """Validation accuracies (step 0, then every `trainer.test_freq`) of the quickstart's RL phase from the
    committed SFT checkpoint."""
    return [m["val/accuracy"] for m in rl_history(tmp, *overrides) if "val/accuracy" in m]


def _assert_gain(stage: str, acc: list[float], margin: float) -> None:
    assert len(acc) >= 2, f"{stage}: no validation after step 0: {acc}"
    gain = acc[-1] - acc[0]
    assert gain >= margin, (f"{stage} from {SFT_CHECKPOINT.name}: validation accuracy {[round(a, 3) for a in acc]} "
                            f"rose {gain:+.3f}, needs >= {margin}")


def sft_val_losses(tmp: Path, *overrides: str) -> list[tuple[int, float]]:
    """(step, val/loss) of the quickstart's SFT recipe on a SFT_STEPS schedule, every 50 steps."""
    from hybridflow.tracking import Tracker
    from hybridflow.trainer.sft import run_sft

    cfg = _cfg(tmp, f"sft.total_steps={SFT_STEPS}", "sft.extra_schedules=0", "trainer.test_freq=50", *overrides)
    with Tracker.from_config(cfg) as tracker:
        run_sft(cfg, out_dir=tmp / "hf", tracker=tracker)
    rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return [(int(r["training/global_step"]), round(r["val/loss"], 4)) for r in rows if "val/loss" in r]


def test_stage1_sft_reaches_its_target(tmp_path: Path) -> None:
    losses = sft_val_losses(tmp_path)
    assert losses and losses[-1][1] <= SFT_MAX_VAL_LOSS, (
        f"SFT stage: val/loss did not reach {SFT_MAX_VAL_LOSS} in sft.total_steps={SFT_STEPS}: {losses}")
    cfg = _cfg(tmp_path)
    missed = "sft_target_missed" in (tmp_path / "run" / "events.jsonl").read_text()
    assert missed == (losses[-1][1] > cfg.sft.target_val_loss), (missed, losses[-1])  # the gate warns iff missed


def test_stage1_moe_sft_reaches_its_target(tmp_path: Path) -> None:
    losses = sft_val_losses(tmp_path, "model.preset=tiny-moe")
    assert losses and losses[-1][1] <= MOE_SFT_MAX_VAL_LOSS, (
        f"MoE SFT stage: val/loss did not reach {MOE_SFT_MAX_VAL_LOSS} in sft.total_steps={SFT_STEPS}: {losses}")


def test_stage2_moe_grpo_with_routing_replay_from_sft_checkpoint(tmp_path: Path) -> None:
    history = rl_history(tmp_path, *MOE_REPLAY, f"trainer.total_training_steps={MOE_RL_STEPS}",
                         checkpoint=MOE_CHECKPOINT)
    agreement = [round(m["moe/routing_agreement"], 4) for m in history if "moe/routing_agreement" in m]
    # fp32 on one CPU: the trainer's routers choose the recorded experts for every token (1.0 in every sweep run);
    # a recording shifted by one column, or routes of other rows, would agree on few tokens
    assert len(agreement) == MOE_RL_STEPS and min(agreement) >= MOE_MIN_AGREEMENT, (
        f"MoE: moe/routing_agreement per step {agreement}, needs >= {MOE_MIN_AGREEMENT} at each of {MOE_RL_STEPS}")
    _assert_gain("MoE GRPO with routing replay", [m["val/accuracy"] for m in history if "val/accuracy" in m],
                 MOE_GRPO_MIN_GAIN)


def test_stage2_grpo_from_sft_checkpoint(tmp_path: Path) -> None:
    _assert_gain("GRPO", rl_from_checkpoint(tmp_path), GRPO_MIN_GAIN)


def test_stage2_lora_grpo_from_sft_checkpoint(tmp_path: Path) -> None:
    _assert_gain("GRPO with LoRA (rank 8, adapters only)", rl_from_checkpoint(tmp_path, *LORA_GRPO), LORA_GRPO_MIN_GAIN)


def test_stage2_ppo_with_critic_from_sft_checkpoint(tmp_path: Path) -> None:
    _assert_gain("PPO (critic, GAE)", rl_from_checkpoint(tmp_path, *PPO_OVERRIDES), PPO_MIN_GAIN)


def test_stage2_grpo_one_step_off_from_sft_checkpoint(tmp_path: Path) -> None:
    # separate rollout worker, batch k+1 generated with the weights before step k's update (staleness 1)
    _assert_gain("GRPO, trainer.mode=one_step_off", rl_from_checkpoint(tmp_path, "trainer.mode=one_step_off"),
                 ONE_STEP_OFF_MIN_GAIN)


@pytest.mark.parametrize("loss", sorted(POLICY_LOSS_MIN_GAIN))
def test_stage2_policy_loss_off_policy_from_sft_checkpoint(tmp_path: Path, loss: str) -> None:
    _assert_gain(f"GRPO with actor.policy_loss={loss}, 4 mini-batches per step",
                 rl_from_checkpoint(tmp_path, f"actor.policy_loss={loss}", *OFF_POLICY), POLICY_LOSS_MIN_GAIN[loss])


def test_stage3_grpo_learns_under_avx2_numerics(tmp_path: Path) -> None:
    # A child process: the ISA switches are read when torch loads.
    code = ("import importlib.util, json, sys; from pathlib import Path;"
            "spec = importlib.util.spec_from_file_location('stages', sys.argv[2]);"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m);"
            "print(json.dumps(m.rl_from_checkpoint(Path(sys.argv[1]))))")
    env = {**os.environ, **AVX2, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path), __file__], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, f"GRPO under AVX2 emulation failed:\n{proc.stderr[-3000:]}"
    _assert_gain("GRPO under AVX2 emulation", json.loads(proc.stdout.strip().splitlines()[-1]), GRPO_MIN_GAIN)
