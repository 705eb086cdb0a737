"""On-policy distillation step vs GRPO step, same student and workload, in one call (random-init preset shapes).

One H200:  PYTHONPATH=. python3 -m benchmarks.distill --out $OUT
           (student qwen2.5-0.5b, teacher qwen2.5-1.5b; the GRPO workload of `benchmarks/run.py`: 32 prompts x 8
           samples, 256 + 256 tokens, bf16, the tuned settings; add --teacher-offload to park the teacher on the CPU)
CPU smoke: PYTHONPATH=. python3 -m benchmarks.distill --student tiny --teacher tiny --device cpu --prompts 4 --n 2 \
               --prompt-len 16 --response-len 8 --steps 1 --warmup 0 --no-tuned --out /tmp/bench
The distillation step adds the `teacher` stage (a forward of the teacher on every sample); the difference of the
median step times is its cost. Output: `<out>/distill.json` and a markdown table (`<out>/bench.md`).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from benchmarks import harness, run
from benchmarks.harness import cell

STAGES = ("gen", "reward", "old_log_prob", "teacher", "adv", "update_actor", "step")


def variants(teacher: str, offload: bool) -> dict[str, list[str]]:
    distill = ["algorithm.adv_estimator=distill", f"teacher.preset={teacher}",
               f"teacher.fsdp.param_offload={str(offload).lower()}"]
    return {"grpo": [], f"distill ({teacher} teacher)": distill}


def table(env: dict[str, str], student: str, results: dict[str, dict[str, Any]]) -> str:
    lines = [f"On-policy distillation vs GRPO, student {student} — {env['date']}, commit {env['commit']}, "
             f"{env['gpu']}, torch {env['torch']}", "",
             "| variant | " + " | ".join(f"timing/{s} (s)" for s in STAGES) + " | tokens/s | peak GB |",
             "|" + "---|" * (len(STAGES) + 3)]
    for name, r in results.items():
        med = r["median"]
        lines.append(f"| {name} | " + " | ".join(cell(med.get(f"timing/{s}")) for s in STAGES)
                     + f" | {cell(r['tokens_per_s'], '{:.0f}')} | {cell(r['peak_memory_gb'], '{:.1f}')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--student", default="qwen2.5-0.5b")
    ap.add_argument("--teacher", default="qwen2.5-1.5b")
    ap.add_argument("--teacher-offload", action="store_true", help="teacher.fsdp.param_offload=true")
    harness.add_workload_args(ap)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tuned", action=argparse.BooleanOptionalAction, default=True)
    harness.add_override_arg(ap, "extra a.b=c config override for both variants; repeatable")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    args.profile, args.stage_peaks = False, False
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    common = list(args.override)
    results = {}
    for name, extra in variants(args.teacher, args.teacher_offload).items():
        args.override = common + extra
        results[name] = run.run_preset(args, args.student, {})
    env = harness.environment()
    harness.write_json(out / "distill.json", {"env": env, "args": vars(args), "results": results})
    harness.write_table(out / "bench.md", table(env, args.student, results))


if __name__ == "__main__":
    main()
