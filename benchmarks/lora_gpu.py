"""LoRA and 7B on one GPU: hybridflow GRPO with LoRA at the Qwen2.5-7B shape, full fine-tuning beside
it, and TRL's GRPOTrainer with the same PEFT config as the anchor, in one device call.

One H200 (≤ 9 min; installs the carried TRL wheels first):  bash benchmarks/lora_gpu_round.sh
    or, TRL already importable:  PYTHONPATH=. python3 -m benchmarks.lora_gpu --out $OUT
Switch time only (0.5B, LoRA vs full):  PYTHONPATH=. python3 -m benchmarks.lora_gpu --parts switch_0.5b,switch_0.5b_full
CPU smoke test (tiny shapes, every part, TRL with PEFT too):  PYTHONPATH=. python3 -m benchmarks.lora_gpu --smoke --out D

Workload (the GPU round's, `benchmarks/run.py`): random-init bf16 model shapes built from presets (no downloads),
32 prompts × 8 samples, 256 random prompt tokens + 256 response tokens (ignore_eos), KL off, one optimizer step per
generation batch. Parts, each in its own process with its own time limit so an OOM or a hang in one leaves the
others; run in this order until `--budget-s` is spent:
  lora_7b          hybridflow GRPO, LoRA rank 64 (alpha 64) on every decoder Linear: per-stage step time, the hybrid
                   switch (adapters merged into the rollout's weights), peak and resting GPU memory
  lora_7b_nockpt   (not in the default list) lora_7b without gradient checkpointing, 4,096-token micro-batches
  trl_7b           TRL GRPOTrainer (HF generate, no vLLM), `peft_config` = the same LoRA, bf16 base: step time, peak
  lora_1.5b        } peak memory of LoRA vs full fine-tuning at 1.5B, same workload and settings
  full_1.5b        }
  full_7b_offload  full-parameter 7B with `actor.fsdp.optimizer_offload=true` (an OOM is reported as one)
  switch_0.5b / switch_0.5b_full   (not in the default list) the switch at 0.5B, small workload, many steps
hybridflow parts use the example's 7B set-up (`examples/grpo_lora_7b.yaml`: gradient checkpointing, token-budget
micro-batches) plus the GPU round's tuned settings (`benchmarks/run.py`, TUNED_COMMON); `--override` adds more.
Output under --out: lora_gpu.jsonl (one row per part, written as each ends), lora_gpu.md (the table, also printed),
lora_gpu.log (every part's output).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness

# The example's 7B set-up (examples/grpo_lora_7b.yaml) for the training passes.
SEVEN_B = ("model.enable_gradient_checkpointing=true", "actor.use_dynamic_bsz=true",
           "actor.ppo_max_token_len_per_gpu=16384", "actor.log_prob_max_token_len_per_gpu=32768")
# The GPU round's tuned settings (benchmarks/run.py, TUNED_COMMON), in two halves: keeping the bf16 unsharded copies
# and the KV cache between steps costs ~20 GB at 7B, so not for the full-parameter 7B part, which needs every GB.
TUNED = ("actor.logprob_chunk_size=4096", "actor.fsdp.defer_grad_sync=true")
KEEP_RESIDENT = ("rollout.free_cache_engine=false", "actor.fsdp.reshard_after_forward=false")


@dataclass(frozen=True)
class Part:
    name: str
    runner: str  # hybridflow | trl
    preset: str
    lora: bool
    overrides: tuple[str, ...] = ()
    timeout_s: int = 120
    small: bool = False  # the switch parts: a small workload, many steps (the switch does not depend on it)
    steps_key: str = "steps"  # which --*steps flag counts its timed steps


# Every part, in the order they run (the LoRA parts get model.lora.* from --lora-rank / --lora-alpha).
PARTS = {p.name: p for p in [
    Part("lora_7b", "hybridflow", "qwen2.5-7b", True, (*SEVEN_B, *TUNED, *KEEP_RESIDENT), timeout_s=210),
    # Without gradient checkpointing (no recomputed forward); a smaller token budget per micro-batch keeps the
    # un-checkpointed activations (~8 MB a token at 7B) in memory.
    Part("lora_7b_nockpt", "hybridflow", "qwen2.5-7b", True,
         ("model.enable_gradient_checkpointing=false", "actor.use_dynamic_bsz=true",
          "actor.ppo_max_token_len_per_gpu=4096", "actor.log_prob_max_token_len_per_gpu=32768", *TUNED,
          *KEEP_RESIDENT), timeout_s=210),
    Part("trl_7b", "trl", "qwen2.5-7b", True, timeout_s=180, steps_key="trl_steps"),
    Part("lora_1.5b", "hybridflow", "qwen2.5-1.5b", True, (*SEVEN_B, *TUNED, *KEEP_RESIDENT), timeout_s=90,
         steps_key="mem_steps"),
    Part("full_1.5b", "hybridflow", "qwen2.5-1.5b", False, (*SEVEN_B, *TUNED, *KEEP_RESIDENT), timeout_s=90,
         steps_key="mem_steps"),
    Part("full_7b_offload", "hybridflow", "qwen2.5-7b", False, (*SEVEN_B, *TUNED, "actor.fsdp.optimizer_offload=true"),
         timeout_s=150, steps_key="mem_steps"),
    Part("switch_0.5b", "hybridflow", "qwen2.5-0.5b", True, (*TUNED, *KEEP_RESIDENT), small=True,
         steps_key="switch_steps"),
    Part("switch_0.5b_full", "hybridflow", "qwen2.5-0.5b", False, (*TUNED, *KEEP_RESIDENT), small=True,
         steps_key="switch_steps"),
]}


DEFAULT_PARTS = "lora_7b,trl_7b,lora_1.5b,full_1.5b,full_7b_offload"
SMOKE = dict(device="cpu", prompts=4, n=2, prompt_len=16, response_len=8, lora_rank=4, lora_alpha=8.0, warmup=0,
             steps=1, trl_steps=1, mem_steps=1, mem_warmup=0, switch_steps=2, budget_s=3600.0)


# ------------------------------------------------------------------------------------------------ child side
def workload(spec: dict[str, Any]) -> dict[str, int]:
    if spec["small"]:
        return dict(prompts=8, n=4, prompt_len=64, response_len=64) if not spec["smoke"] else \
            dict(prompts=2, n=2, prompt_len=8, response_len=4)
    return {k: spec[k] for k in ("prompts", "n", "prompt_len", "response_len")}


def run_hybridflow(spec: dict[str, Any], save: Any) -> dict[str, Any]:
    """`warmup + steps` GRPO steps of PPOTrainer on synthetic batches; per-step timings and memory, saved as they
    come (a later OOM or timeout keeps the steps before it)."""
    import torch

    from benchmarks.run import bench_overrides, synthetic_batch, track_stage_peaks
    from hybridflow.config import load_config
    from hybridflow.models.presets import preset_config
    from hybridflow.trainer.ppo import PPOTrainer

    w = workload(spec)
    lora = [f"model.lora.rank={spec['lora_rank']}", f"model.lora.alpha={spec['lora_alpha']}",
            "model.lora.target_modules=all-linear"] if spec["lora"] else []
    ns = argparse.Namespace(device=spec["device"], tuned=False, override=[*spec["overrides"], *lora], **w)
    cfg = load_config(overrides=bench_overrides(ns, spec["preset"]))
    cuda = spec["device"] != "cpu" and torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    stage_peaks = track_stage_peaks(dev)
    t0 = time.perf_counter()
    trainer = PPOTrainer(cfg)
    res: dict[str, Any] = {"startup_s": time.perf_counter() - t0, "workload": w, "overrides": ns.override,
                           "steps": []}
    if cuda:
        res["resting_gb"] = torch.cuda.memory_allocated() / 2**30  # weights (+ optimizer state) before step 1
        res["build_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    save(res)
    vocab = preset_config(spec["preset"]).vocab_size
    try:
        for i in range(spec["warmup"] + spec["steps"]):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            trainer.global_step += 1
            m = trainer.step(synthetic_batch(w["prompts"], w["prompt_len"], vocab, i))
            if cuda:  # each stage resets the peak (track_stage_peaks): the step's is the largest of them
                m |= stage_peaks
                m["perf/step_peak_memory_gb"] = max([torch.cuda.max_memory_allocated() / 2**30,
                                                     *stage_peaks.values()])
                m["perf/step_peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
                m["perf/after_step_allocated_gb"] = torch.cuda.memory_allocated() / 2**30
            res["steps"].append({k: v for k, v in m.items() if k.startswith(("timing/", "perf/", "actor/mfu"))})
            print(f"{spec['name']} step {i}: {m['timing/step']:.3f}s switch {m.get('timing/switch', 0) * 1e3:.1f}ms "
                  f"peak {m.get('perf/step_peak_memory_gb', 0):.1f}GB", flush=True)
            save(res)
    finally:
        trainer.close()
    timed = res["steps"][spec["warmup"]:] or res["steps"]
    res["median"] = harness.summarize(timed)
    switch = [s["timing/switch"] for s in timed if "timing/switch" in s]
    if switch:
        res["switch_ms"] = {"median": 1e3 * statistics.median(switch), "max": 1e3 * max(switch), "n": len(switch)}
    res["peak_gb"] = max((s.get("perf/step_peak_memory_gb", 0.0) for s in res["steps"]), default=None) if cuda \
        else None
    return res


def run_trl(spec: dict[str, Any], save: Any) -> dict[str, Any]:
    """TRL's GRPOTrainer through `benchmarks/trl_grpo.py` with the same LoRA as a `peft_config` (bf16 base on GPU)."""
    from benchmarks import trl_grpo

    w = workload(spec)
    args = trl_grpo.parser().parse_args([
        "--preset", spec["preset"], "--device", spec["device"], "--prompts", str(w["prompts"]), "--n", str(w["n"]),
        "--prompt-len", str(w["prompt_len"]), "--response-len", str(w["response_len"]),
        "--ga", str(spec["trl_ga"]), "--steps", str(spec["steps"]), "--lora-rank", str(spec["lora_rank"]),
        "--lora-alpha", str(spec["lora_alpha"]), "--dtype", "float32" if spec["smoke"] else "bfloat16"])
    res = trl_grpo.run(args)
    res["peak_gb"] = max(res["peak_memory_gb"], default=None)
    return res


def child(spec_json: str, result_path: Path) -> None:
    spec = json.loads(spec_json)
    save = functools.partial(harness.write_json, result_path, indent=None)
    save((run_trl if spec["runner"] == "trl" else run_hybridflow)(spec, save))


# ----------------------------------------------------------------------------------------------- parent side
def launch(part: Part, spec: dict[str, Any], limit_s: float, log_path: Path) -> dict[str, Any]:
    """Run one part in a child process (its own process group: a timeout kills its compile workers too) under
    `limit_s`, its output streamed into `log_path`; its row for lora_gpu.jsonl."""
    row: dict[str, Any] = {"part": part.name, "runner": part.runner, "preset": spec["preset"],
                           "lora_rank": spec["lora_rank"] if part.lora else 0, "limit_s": round(limit_s)}
    with tempfile.TemporaryDirectory() as tmp, open(log_path, "a") as log:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "benchmarks.lora_gpu", "--child", json.dumps(spec), "--result", str(result)]
        log.write(f"\n===== {part.name} (limit {limit_s:.0f}s): {json.dumps(spec)}\n")
        log.flush()
        offset = log.tell()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        if result.exists():
            row["result"] = json.loads(result.read_text())
    with open(log_path, errors="replace") as fh:
        fh.seek(offset)
        output = fh.read()
    oom = re.search(r"(OutOfMemoryError|CUDA out of memory)[^\n]*", output)
    if rc == 0:
        row["status"] = "ok"
    elif rc is None:
        row["status"] = "timeout"
    else:
        row["status"] = "oom" if oom else f"error rc={rc}"
    if rc != 0:
        row["error"] = oom.group(0)[:600] if oom else output[-1500:]
    return row


def part_spec(part: Part, args: argparse.Namespace) -> dict[str, Any]:
    preset = "tiny" if args.smoke else part.preset
    steps = getattr(args, part.steps_key)
    warmup = {"steps": args.warmup, "trl_steps": 1, "mem_steps": args.mem_warmup,
              "switch_steps": args.warmup if args.smoke else max(args.warmup, 2)}[part.steps_key]
    return {"name": part.name, "runner": part.runner, "preset": preset, "lora": part.lora,
            "overrides": [*part.overrides, *args.override], "device": args.device, "prompts": args.prompts,
            "n": args.n, "prompt_len": args.prompt_len, "response_len": args.response_len, "small": part.small,
            "lora_rank": args.lora_rank, "lora_alpha": args.lora_alpha, "warmup": warmup, "steps": steps,
            "trl_ga": args.trl_ga, "smoke": args.smoke}


def summary_row(row: dict[str, Any]) -> dict[str, Any]:
    """The table's numbers of one part (None where the part did not get there)."""
    r = row.get("result") or {}
    if row["runner"] == "trl":
        return {"step_s": r.get("median_step_s"), "gen_s": r.get("median_gen_s"), "peak_gb": r.get("peak_gb"),
                "steps_done": len(r.get("step_s") or [])}
    med = r.get("median") or {}
    if not med and r.get("steps"):  # stopped after some steps: the last one's numbers
        med = r["steps"][-1]
    return {"step_s": med.get("timing/step"), "gen_s": med.get("timing/gen"),
            "update_s": med.get("timing/update_actor"), "switch_ms": (r.get("switch_ms") or {}).get("median"),
            "switch_max_ms": (r.get("switch_ms") or {}).get("max"),
            "peak_gb": r.get("peak_gb") or med.get("perf/step_peak_memory_gb"),
            "gen_peak_gb": med.get("perf/peak_gb/generate"), "resident_gb": med.get("perf/after_step_allocated_gb"),
            "startup_s": r.get("startup_s"), "steps_done": len(r.get("steps") or [])}


def markdown(env: dict[str, str], rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    def f(v: Any, fmt: str = "{:.2f}") -> str:
        return "–" if v is None else fmt.format(v)

    smoke = " [smoke: tiny shapes on CPU, part names as on the GPU]" if args.smoke else ""
    lines = [f"LoRA on one GPU{smoke} — {env['date']}, commit {env['commit']}, {env['gpu']}, torch {env['torch']}",
             f"workload {args.prompts} prompts × {args.n}, {args.prompt_len} + {args.response_len} tokens; LoRA rank "
             f"{args.lora_rank}, alpha {args.lora_alpha:g}, all-linear; TRL: GRPOTrainer, HF generate (no vLLM)",
             "", "| part | status | steps | step s | gen s | update_actor s | switch ms (median / max) | peak GB "
             "| gen peak GB | resident GB after a step | startup s | wall s |", "|" + "---|" * 12]
    by = {r["part"]: summary_row(r) for r in rows}
    for r in rows:
        s = by[r["part"]]
        switch = f"{f(s.get('switch_ms'), '{:.1f}')} / {f(s.get('switch_max_ms'), '{:.1f}')}" \
            if s.get("switch_ms") is not None else "–"
        lines.append(f"| {r['part']} | {r['status']} | {s.get('steps_done', 0)} | {f(s.get('step_s'))} "
                     f"| {f(s.get('gen_s'))} | {f(s.get('update_s'))} | {switch} | {f(s.get('peak_gb'), '{:.1f}')} "
                     f"| {f(s.get('gen_peak_gb'), '{:.1f}')} | {f(s.get('resident_gb'), '{:.1f}')} "
                     f"| {f(s.get('startup_s'), '{:.0f}')} | {f(r.get('wall_s'), '{:.0f}')} |")
    ours, trl = (by.get("lora_7b") or {}).get("step_s"), (by.get("trl_7b") or {}).get("step_s")
    if ours and trl:
        lines += ["", f"7B LoRA step: hybridflow {ours:.2f} s vs TRL {trl:.2f} s = **{trl / ours:.1f}×** (target ≥ 8×)"]
    for r in rows:
        if r.get("error"):
            lines += ["", f"{r['part']} ({r['status']}): " + r["error"].strip().splitlines()[-1][:300]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=DEFAULT_PARTS, help=f"comma-separated, in run order (default {DEFAULT_PARTS})")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    harness.add_workload_args(ap)
    ap.add_argument("--lora-rank", type=int, default=64)
    ap.add_argument("--lora-alpha", type=float, default=64.0)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (compile, CUDA graphs)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps of lora_7b")
    ap.add_argument("--mem-steps", type=int, default=1, help="steps of the 1.5B parts and full_7b_offload")
    ap.add_argument("--mem-warmup", type=int, default=0,
                    help="untimed steps before those (0: the peak of step 1 counts; its time includes compilation)")
    ap.add_argument("--trl-steps", type=int, default=1, help="timed TRL steps (after one warm-up step)")
    ap.add_argument("--switch-steps", type=int, default=8, help="timed steps of the switch parts")
    ap.add_argument("--trl-ga", type=int, default=8, help="TRL gradient accumulation steps per optimizer step")
    ap.add_argument("--budget-s", type=float, default=530.0, help="all parts together; a part gets what is left")
    ap.add_argument("--timeout", action="append", default=[], metavar="PART=S", help="a part's own limit")
    harness.add_override_arg(ap, "a.b=c for every hybridflow part; repeatable")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, one step each (checks the code paths)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, Path(args.result))
        return
    harness.apply_smoke(args, SMOKE)
    known = PARTS
    names = [p for p in args.parts.split(",") if p]
    unknown = [p for p in names if p not in known]
    if unknown:
        raise SystemExit(f"--parts: unknown {unknown}; choose from {', '.join(known)}")
    timeouts = {}
    for t in args.timeout:
        name, _, sec = t.partition("=")
        if name not in known or not sec:
            raise SystemExit(f"--timeout {t}: use PART=SECONDS with PART one of {', '.join(known)}")
        timeouts[name] = float(sec)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = harness.environment(cuda_context=False)  # the parts, in child processes, need the GPU's memory
    deadline = time.perf_counter() + args.budget_s
    rows = []
    with open(out / "lora_gpu.jsonl", "a") as jsonl:
        for name in names:
            part = known[name]
            spec = part_spec(part, args)
            left = deadline - time.perf_counter()
            limit = min(timeouts.get(name, 300.0 if args.smoke else part.timeout_s), left)
            if part.runner == "trl" and importlib.util.find_spec("trl") is None:
                row = {"part": name, "runner": "trl", "status": "skipped: trl not importable (carry its wheels, "
                       "see benchmarks/lora_gpu_round.sh)"}
            elif left < 20:
                row = {"part": name, "runner": part.runner, "status": f"skipped: {left:.0f}s of --budget-s left"}
            else:
                row = launch(part, spec, limit, out / "lora_gpu.log")
            row["env"] = env
            rows.append(row)
            jsonl.write(json.dumps(row, default=str) + "\n")
            jsonl.flush()
            print(f"{name}: {row['status']} ({row.get('wall_s', 0):.0f}s)", flush=True)
    harness.write_table(out / "lora_gpu.md", markdown(env, rows, args))


if __name__ == "__main__":
    main()
