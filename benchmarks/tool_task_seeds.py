"""RL on the calculator tool task from the committed SFT checkpoint, over seeds × CPU numerics: the numbers behind
the margins of tests/e2e/test_tool_task_learning.py (docs/benchmarks.md, "Tool task learning").

    python -m benchmarks.tool_task_seeds --seeds 0-4 --numerics default,avx2 --algos grpo,ppo --jobs 2 \
        --out runs/tool_task_seeds [k=v ...]

Each run is the RL phase of examples/tool_calculator.yaml (multi-turn rollouts, calculator tool, exact-answer
reward; `grpo_agent`: the same GRPO with each trajectory driven through the OpenAI-compatible endpoint by
examples/agents/tool_calculator.py) from `tests/assets/sft_tool_calculator`, in its own process with one intra-op thread, with the RL seeds
shifted by `s` (rollout.seed=s, trainer.seed=s+1; the data split stays the checkpoint's). `avx2` emulates an
AVX2-only CPU (`benchmarks/quickstart_seeds.NUMERICS`). Per run: validation success rate (sampled at temperature 1)
and share of well-formed calls before RL and at each validation, their gains, time. Output: `<out>/runs.jsonl`
(a line per run, appended as runs finish) and a min / median / max table per algorithm.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import harness

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tool_calculator.yaml"
CHECKPOINT = ROOT / "tests" / "assets" / "sft_tool_calculator"
# The RL phase the tests and this sweep run: the example's 20 steps, validated before and after only; PPO with a critic
# 15 (its margins held at 15 over 5 seeds x 2 numerics; GRPO's well-formed gain did not: docs/benchmarks.md, "Tool task
# RL at 15 steps").
RL_OVERRIDES = ("trainer.total_training_steps=20", "trainer.test_freq=20", "data.train_size=2000")
PPO_OVERRIDES = ("algorithm.adv_estimator=gae", "algorithm.lam=0.95", "critic.optim.lr=1e-3",
                 "critic.ppo_mini_batch_size=16", "critic.ppo_micro_batch_size_per_gpu=128", "critic.warmup_steps=2",
                 "trainer.total_training_steps=15", "trainer.test_freq=15")
# GRPO with the rollout driven by the OpenAI-client agent (`rollout.agent.mode=server`) instead of in-engine turns
AGENT_OVERRIDES = ("rollout.multi_turn.enable=false", "rollout.agent.mode=server",
                   f"rollout.agent.path={ROOT / 'examples' / 'agents' / 'tool_calculator.py'}")
ALGOS = {"grpo": (), "ppo": PPO_OVERRIDES, "grpo_agent": AGENT_OVERRIDES}
SUCCESS, WELL_FORMED = "val/accuracy", "val/rule/well_formed"


def rl_from_checkpoint(run_dir: Path, *overrides: str) -> dict[str, list[float]]:
    """Validation success rate and well-formed-call share (step 0, then every `trainer.test_freq`) of the example's
    RL phase from the committed SFT checkpoint, in this process."""
    from hybridflow.config import load_config
    from hybridflow.trainer.run import run_ppo

    cfg = load_config([EXAMPLE], [f"model.path={CHECKPOINT}", f"trainer.run_dir={run_dir}",
                                  f"trainer.default_local_dir={run_dir}/ckpt", "trainer.logger=[jsonl]",
                                  *RL_OVERRIDES, *overrides])
    history = run_ppo(cfg)
    return {"steps": [int(m["training/global_step"]) for m in history if SUCCESS in m],
            "success": [m[SUCCESS] for m in history if SUCCESS in m],
            "well_formed": [m[WELL_FORMED] for m in history if SUCCESS in m]}


def launch(out: Path, seed: int, numerics: str, algo: str, overrides: list[str]) -> dict[str, Any]:
    run_dir = out / f"{algo}_{numerics}_s{seed}"
    cmd = [sys.executable, "-m", "benchmarks.tool_task_seeds", "--child", str(run_dir), f"rollout.seed={seed}",
           f"trainer.seed={seed + 1}", *ALGOS[algo], *overrides]
    row = harness.run_child(cmd, {"algo": algo, "seed": seed, "numerics": numerics, "overrides": overrides},
                            out / "runs.jsonl", harness.NUMERICS[numerics], ROOT,
                            lambda res: {"success_gain": res["success"][-1] - res["success"][0],
                                         "well_formed_gain": res["well_formed"][-1] - res["well_formed"][0]})
    status = (f"success {100 * row['success'][0]:.1f}% -> {100 * row['success'][-1]:.1f}%, well-formed "
              f"{100 * row['well_formed'][0]:.1f}% -> {100 * row['well_formed'][-1]:.1f}%" if "success" in row
              else f"FAILED rc={row['returncode']}")
    print(f"{algo} {numerics} seed {seed}: {status} ({row['wall_seconds']:.0f}s)", flush=True)
    return row


def summarize(rows: list[dict[str, Any]]) -> str:
    """min / median / max per algorithm × numerics and per algorithm over both numerics (points = percent)."""
    lines = ["| algo | numerics | runs | failed | success start % | success end % | success gain | "
             "well-formed start % | well-formed end % | well-formed gain | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def mmm(vals: list[float], scale: float = 100.0) -> str:  # percent unless told
        return harness.min_med_max(vals, scale)

    for algo in sorted({r["algo"] for r in rows}):
        for g in sorted({r["numerics"] for r in rows}) + ["all"]:
            rs = [r for r in rows if r["algo"] == algo and g in ("all", r["numerics"])]
            ok = [r for r in rs if "success" in r]
            lines.append(f"| {algo} | {g} | {len(rs)} | {len(rs) - len(ok)} | "
                         f"{mmm([r['success'][0] for r in ok])} | {mmm([r['success'][-1] for r in ok])} | "
                         f"{mmm([r['success_gain'] for r in ok])} | {mmm([r['well_formed'][0] for r in ok])} | "
                         f"{mmm([r['well_formed'][-1] for r in ok])} | {mmm([r['well_formed_gain'] for r in ok])} | "
                         f"{mmm([r['wall_seconds'] for r in ok], 1.0)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_sweep_args(parser, seeds="0-4", out="runs/tool_task_seeds")
    parser.add_argument("--algos", default="grpo,ppo")
    args = parser.parse_intermixed_args()
    if args.child:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(rl_from_checkpoint(Path(args.child), *args.overrides)))
        return
    numerics = harness.parse_choices(args.numerics, harness.NUMERICS, "--numerics")
    algos = harness.parse_choices(args.algos, ALGOS, "--algos")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(s, n, a) for a in algos for n in numerics for s in harness.parse_seeds(args.seeds)]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda j: launch(out, j[0], j[1], j[2], args.overrides), jobs))
    harness.write_table(out / "summary.md", summarize(rows), append=False)


if __name__ == "__main__":
    main()
