"""The full RLHF pipeline on a built-in task: SFT → reward model → PPO/GRPO driven by the RM.

1. SFT the tiny model on the task's (prompt, "#### <answer>") rows (default task: sort 4 digits).
2. Train a Bradley-Terry reward model, initialised from the SFT model, on synthetic pairs: chosen = the correct
   answer, rejected = a wrong one (`hybridflow.trainer.synthetic_pairs`: unsorted / wrong digits for sort; near
   misses, random numbers, a missing `####` for arithmetic). Validation accuracy should be far above 0.5.
3. RL from the SFT model with the RM mixed with the rule reward by weight (`reward.sources`, default 0.7 RM +
   0.3 rule as in the seed; `--rule-weight 0` = RM only). The TRUE metric — the rule scorer's accuracy of greedy
   answers on held-out problems — is measured before and after RL.

    .venv/bin/python examples/rlhf_pipeline.py --workdir runs/rlhf [a.b=c ...]

Overrides apply to every stage; stage lengths and the rule weight are flags. Measured (2 CPU cores, tiny 0.1M model, sort): SFT 25% exact; RM held-out pair accuracy 0.69-0.92 depending on
its head's init; with 0.7 RM + 0.3 rule (actor lr 1e-4) the true accuracy went 0.25 → 0.42 with a 0.84 RM and
0.25 → 0.08 with a 0.69 RM, the RM score rising in both; RM only: 0.25 → 0.06 (the policy exploits the RM);
rule only: 0.25 → 0.56. On one H200, a 3.2M model (hidden 256, 4 layers), 1500 SFT steps: 100% exact, RM 0.95.
Correct-vs-wrong ADDITION (`data.task=arithmetic
data.max_response_length=12`) needs a model that can add: the tiny models stay near 1% exact accuracy and their
RMs near 0.6 on near-miss answers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from hybridflow.config import Config, load_config

logger = logging.getLogger("rlhf_pipeline")

# Small and fast on 2 CPU cores; every value can be overridden on the command line.
BASE_OVERRIDES = [
    "model.preset=tiny", "data.task=sort", "data.train_size=4096", "data.val_size=64",
    "data.max_prompt_length=64", "data.max_response_length=16",
    "trainer.device=cpu", "trainer.backend=local", "trainer.logger=[jsonl]", "trainer.resume_mode=disable",
    "trainer.checkpoint.save_freq=0", "trainer.val_before_train=false", "trainer.test_freq=-1",
    "sft.batch_size=64", "sft.micro_batch_size_per_gpu=64",
    "sft.optim.lr=3e-3", "sft.optim.lr_scheduler=constant",
    "rm.batch_size=32", "rm.micro_batch_size_per_gpu=32", "rm.optim.lr=1e-3", "rm.optim.lr_scheduler=cosine",
    "data.train_batch_size=16", "rollout.n=8", "actor.ppo_mini_batch_size=16",
    "actor.ppo_micro_batch_size_per_gpu=128", "actor.log_prob_micro_batch_size_per_gpu=128",
    "actor.optim.lr=1e-4", "algorithm.adv_estimator=grpo", "rollout.val_kwargs.do_sample=false",
]


def stage_config(workdir: Path, stage: str, overrides: list[str], extra: list[str] = ()) -> Config:
    return load_config([], [*BASE_OVERRIDES, f"trainer.experiment_name={stage}",
                            f"trainer.run_dir={workdir / stage}", f"trainer.default_local_dir={workdir / stage / 'ckpt'}",
                            *overrides, *extra])


def run_sft_stage(workdir: Path, overrides: list[str], steps: int) -> tuple[Path, dict[str, float]]:
    from hybridflow.trainer.sft import SFTTrainer
    from hybridflow.trainer.supervised import run_supervised

    cfg = stage_config(workdir, "sft", overrides, [f"sft.total_steps={steps}", f"sft.export_dir={workdir / 'sft_hf'}"])
    path, history = run_supervised(SFTTrainer, cfg)
    return path, history[-1]


def run_rm_stage(workdir: Path, overrides: list[str], steps: int, init_from: Path) -> tuple[Path, dict[str, float]]:
    from hybridflow.trainer.rm import RMTrainer
    from hybridflow.trainer.supervised import run_supervised

    cfg = stage_config(workdir, "rm", overrides, [f"rm.total_steps={steps}", f"rm.init_from={init_from}",
                                                  f"rm.export_dir={workdir / 'rm_hf'}"])
    path, history = run_supervised(RMTrainer, cfg)
    return path, history[-1]


def true_metric_validator(cfg: Config, trainer: Any) -> tuple[Any, Any]:
    """(validator, its reward manager): greedy held-out answers scored by the task's RULE only (the true metric)."""
    from hybridflow.config.schema import RewardSourceConfig
    from hybridflow.rewards import RewardManager
    from hybridflow.trainer.validation import Validator

    rule_cfg = dataclasses.replace(cfg.reward, sources=[RewardSourceConfig(name="rule", weight=1.0)])
    scorer = RewardManager(rule_cfg, trainer.tokenizer, cfg.data.max_response_length)
    return Validator(cfg, trainer.val_ds, trainer.actor, scorer), scorer


def run_ppo_stage(workdir: Path, overrides: list[str], steps: int, sft_dir: Path, rm_dir: Path,
                  rule_weight: float) -> dict[str, Any]:
    """RL with the RM (weight 1 - rule_weight) and the rule (rule_weight); true metric before/after."""
    from hybridflow.tracking import Tracker
    from hybridflow.trainer.ppo import PPOTrainer

    sources = [f"{{name: model, weight: {1.0 - rule_weight}}}"]
    if rule_weight > 0:
        sources.append(f"{{name: rule, weight: {rule_weight}}}")
    cfg = stage_config(workdir, "ppo", overrides, [
        f"model.path={sft_dir}", "reward.reward_model.enable=true", f"reward.reward_model.path={rm_dir}",
        f"reward.sources=[{', '.join(sources)}]", f"trainer.total_training_steps={steps}"])
    tracker = Tracker.from_config(cfg)
    trainer = PPOTrainer(cfg, tracker=tracker)
    # The held-out metric here is the rule's (below); the trainer's own validator would need RM scores too.
    trainer.validator = None
    truth, scorer = true_metric_validator(cfg, trainer)
    try:
        before = truth.run(step=0)["val/accuracy"]
        history = trainer.fit()
        after = truth.run(step=steps)["val/accuracy"]
    finally:
        scorer.close()
        trainer.close()
        tracker.close()
    rm_scores = [m["reward/model/mean"] for m in history if "reward/model/mean" in m]
    return {"true_accuracy_before": before, "true_accuracy_after": after, "rm_score_first": rm_scores[0],
            "rm_score_last": rm_scores[-1], "history": history}


def run_pipeline(workdir: str | Path, overrides: list[str] = (), *, sft_steps: int = 150, rm_steps: int = 250,
                 ppo_steps: int = 30, rule_weight: float = 0.3) -> dict[str, Any]:
    """Run the three stages; returns a summary (SFT/RM validation, true accuracy before/after RL, RM scores)."""
    workdir, overrides = Path(workdir), list(overrides)
    t0 = time.perf_counter()
    sft_dir, sft_last = run_sft_stage(workdir, overrides, sft_steps)
    t1 = time.perf_counter()
    rm_dir, rm_last = run_rm_stage(workdir, overrides, rm_steps, sft_dir)
    t2 = time.perf_counter()
    ppo = run_ppo_stage(workdir, overrides, ppo_steps, sft_dir, rm_dir, rule_weight)
    t3 = time.perf_counter()
    summary = {
        "sft_val_loss": sft_last.get("val/loss"), "sft_val_token_accuracy": sft_last.get("val/token_accuracy"),
        "rm_val_accuracy": rm_last.get("val/accuracy"), "rm_val_reward_margin": rm_last.get("val/reward_margin"),
        **{k: v for k, v in ppo.items() if k != "history"},
        "seconds": {"sft": t1 - t0, "rm": t2 - t1, "ppo": t3 - t2},
        "sft_dir": str(sft_dir), "rm_dir": str(rm_dir),
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return {**summary, "ppo_history": ppo["history"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="runs/rlhf_pipeline")
    parser.add_argument("--sft-steps", type=int, default=150)
    parser.add_argument("--rm-steps", type=int, default=250)
    parser.add_argument("--ppo-steps", type=int, default=30)
    parser.add_argument("--rule-weight", type=float, default=0.3,
                        help="weight of the rule reward mixed with the RM (0.3 = 0.7 RM + 0.3 rule; 0 = RM only)")
    parser.add_argument("overrides", nargs="*", metavar="a.b=c")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = run_pipeline(args.workdir, args.overrides, sft_steps=args.sft_steps, rm_steps=args.rm_steps,
                           ppo_steps=args.ppo_steps, rule_weight=args.rule_weight)
    summary.pop("ppo_history")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
