"""GPU benchmark suite: the GRPO step loop on the TRL-equivalent workload, per stage, against the hardware ceilings.

Run on one GPU:  PYTHONPATH=/tmp/site:. python3 -m benchmarks.trl_grpo --out $OUT   (optional, first: the peer)
                 PYTHONPATH=. python3 -m benchmarks.run --suite gpu --out $OUT
CPU smoke test:  PYTHONPATH=. python3 -m benchmarks.run --preset tiny --device cpu --prompts 4 --n 2 \
                     --prompt-len 16 --response-len 8 --steps 1 --out /tmp/bench
Workload: 32 prompts x 8 samples, 256 random prompt tokens + 256 response tokens (ignore_eos), KL off,
bf16, one optimizer step per generation (on-policy, so old_log_prob is skipped) — the same as
`benchmarks/trl_grpo.py`. Batches are built here (random token ids) and fed to `PPOTrainer.step`, so the step
loop is the trainer's own. Reported per preset: `timing/*`, tokens/s, decode % of the HBM roofline, actor-update
MFU, peak memory, `timing/switch`, GPU busy fraction over one profiled step (torch.profiler, host and CUDA
activity: each large idle gap is attributed to the trainer stage and host ops running meanwhile). The process sets
its CPU threads as the `hybridflow` commands do (`trainer.cpu_threads`, OpenMP passive waits).
Output: `<out>/bench_<preset>.json` plus a markdown table printed last.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as hybridflow/cli.py: before torch loads its OpenMP runtime

import argparse
import functools
import json
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import harness
from benchmarks.harness import cell
from hybridflow.config import load_config
from hybridflow.protocol import DataProto
from hybridflow.rewards.registry import REWARD_FUNCTIONS

log = logging.getLogger("bench.run")
BENCH_SOURCE = "bench_length_mod5"


@REWARD_FUNCTIONS.register(BENCH_SOURCE, override=True)
def length_mod5(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """Cheap, varied reward (GRPO needs non-constant groups); the same function `trl_grpo.py` uses."""
    return (len(solution_str) % 5) / 4.0


# ------------------------------------------------------------------------------------------------ ceilings
def measure_ceilings(dev: torch.device) -> dict[str, float]:
    """Measured copy bandwidth (read + write bytes/s) and bf16 matmul rate on random data."""
    if dev.type != "cuda":
        return {}
    a = torch.empty(2**30, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    torch.cuda.synchronize()
    bw = 2 * a.numel() * 2 * 20 / (time.perf_counter() - t0)
    del a, b
    x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    y = torch.randn_like(x)
    for _ in range(3):
        x @ y
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        x @ y
    torch.cuda.synchronize()
    flops = 2 * 8192**3 * 10 / (time.perf_counter() - t0)
    del x, y
    torch.cuda.empty_cache()
    return {"hbm_bytes_per_s": bw, "bf16_flops_per_s": flops}


# ------------------------------------------------------------------------------------------------- workload
# `--tuned` (default for --suite gpu): settings measured faster on one H200 (2026-11-30), not yet the defaults.
# Keeping the rollout runner (KV cache 1.5 GiB for 0.5B, CUDA graphs, compiled ops) across steps saved 1.4 s/step
# when decode compilation fails and is retried per step; no reshard on one GPU skips re-casting fp32 params in
# backward; micro-batches of 32k (0.5B) / 16k (1.5B) tokens instead of 8k cut per-micro-batch host overhead.
# defer_grad_sync=true: one reduce-scatter per mini-batch on N ranks too (the same as auto on one rank).
TUNED_COMMON = ["rollout.free_cache_engine=false", "actor.fsdp.reshard_after_forward=false", "actor.logprob_chunk_size=4096",
                "actor.fsdp.defer_grad_sync=true"]
TUNED_PRESET = {"qwen2.5-0.5b": ["actor.ppo_micro_batch_size_per_gpu=64"],
                "qwen2.5-1.5b": ["actor.ppo_micro_batch_size_per_gpu=32"]}


def tuned_overrides(preset: str) -> list[str]:
    return TUNED_COMMON + TUNED_PRESET.get(preset, [])


def bench_config(args: argparse.Namespace, preset: str) -> Any:
    return load_config(overrides=bench_overrides(args, preset))


def bench_overrides(args: argparse.Namespace, preset: str) -> list[str]:
    prompts = args.prompts
    return [
        f"model.preset={preset}", f"trainer.device={args.device}", "trainer.checkpoint.save_freq=0",
        "trainer.val_before_train=false", "trainer.logger=[]", "data.train_size=64", "data.val_size=8",
        "data.truncation=left",
        f"data.max_prompt_length={args.prompt_len}", f"data.max_response_length={args.response_len}",
        f"data.train_batch_size={prompts}", f"actor.ppo_mini_batch_size={prompts}", f"rollout.n={args.n}",
        "rollout.ignore_eos=true", f"rollout.max_num_seqs={prompts * args.n}",
        f"reward.sources=[{{name: {BENCH_SOURCE}, weight: 1.0}}]", "algorithm.adv_estimator=grpo",
        "actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false", "trainer.total_training_steps=1000",
        *(tuned_overrides(preset) if args.tuned else []), *args.override,
    ]


def synthetic_batch(prompts: int, prompt_len: int, vocab: int, step: int) -> DataProto:
    """Random prompt token ids (no padding), with the non-tensor columns the trainer's reward stage reads."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(min(100, vocab // 2), vocab, (prompts, prompt_len), generator=g)  # skip special ids
    mask = torch.ones_like(ids)
    pos = torch.arange(prompt_len).expand(prompts, -1).clone()

    def col(values: list[Any]) -> np.ndarray:
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    idx = [step * prompts + i for i in range(prompts)]
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": pos},
        non_tensors={"uid": col([f"s{i}" for i in idx]), "data_source": col([BENCH_SOURCE] * prompts),
                     "reward_model": col([{"style": "rule", "ground_truth": None}] * prompts),
                     "extra_info": col([{}] * prompts), "index": col(idx)},
    )


# -------------------------------------------------------------------------------------------------- profile
def busy_spans(prof: Any) -> tuple[int, list[tuple[int, int, str, str]], int, int]:
    """Union of a profile's device-activity intervals: (busy ns, gaps as (idle ns, offset from the first kernel,
    kernel before, kernel after), first start ns, last end ns)."""
    spans = []
    for ev in prof.profiler.kineto_results.events():
        if ev.device_type() == torch.autograd.DeviceType.CUDA and ev.duration_ns() > 0:
            spans.append((ev.start_ns(), ev.start_ns() + ev.duration_ns(), ev.name()))
    spans.sort()
    busy, end, last = 0, None, ""
    gaps = []
    for s, e, name in spans:
        if end is None or s > end:
            if end is not None:
                gaps.append((s - end, end - spans[0][0], last, name))
            busy += e - s
            end, last = e, name
        elif e > end:
            busy += e - end
            end, last = e, name
    return busy, gaps, (spans[0][0] if spans else 0), (end or 0)


def host_ranges(prof: Any) -> list[tuple[int, int, str]]:
    """The profile's host-side ranges (aten ops and `record_function` annotations such as `stage/reward`)."""
    return [(ev.start_ns(), ev.start_ns() + ev.duration_ns(), ev.name())
            for ev in prof.profiler.kineto_results.events()
            if ev.device_type() == torch.autograd.DeviceType.CPU and ev.duration_ns() > 0]


def attribute_gap(start: int, end: int, ranges: list[tuple[int, int, str]], top: int = 6) -> dict[str, Any]:
    """What the host was doing during the idle GPU interval [start, end) (ns): the trainer stages (`stage/*`) and
    the host ranges that overlap it most, in ms of overlap."""
    stages: dict[str, float] = defaultdict(float)
    ops: dict[str, float] = defaultdict(float)
    for s, e, name in ranges:
        overlap = min(e, end) - max(s, start)
        if overlap <= 0:
            continue
        (stages if name.startswith("stage/") else ops)[name[:80]] += overlap / 1e6
    ranked = sorted(ops.items(), key=lambda kv: -kv[1])[:top]
    return {"stages": {k: round(v, 2) for k, v in sorted(stages.items(), key=lambda kv: -kv[1])},
            "host": {k: round(v, 2) for k, v in ranked}}


def busy_fraction(trainer: Any, batch: DataProto) -> dict[str, Any]:
    """One step under torch.profiler (host and CUDA activity): union of device-activity intervals over the step's
    wall time, the kernels that took the most time, and for the largest idle gaps what the host was doing (the
    host recording makes this step's host work slower than the timed steps'; only the attribution is read from it)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        trainer.step(batch)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    busy, gaps, first, last_end = busy_spans(prof)
    ranges = host_ranges(prof)
    window = (last_end - first) / 1e9
    top = sorted(prof.key_averages(), key=lambda a: a.device_time_total, reverse=True)[:25]
    kernels = [{"name": a.key[:160], "ms": a.device_time_total / 1e3, "calls": a.count} for a in top]
    idle = {f">= {lo} us": sum(g for g, *_ in gaps if g >= lo * 1e3) / 1e6 for lo in (10, 100, 1000)}
    largest = [{"idle_ms": g / 1e6, "at_ms": at / 1e6, "after": a[:80], "before": b[:80],
                **(attribute_gap(first + at, first + at + g, ranges) if rank < 8 else {})}
               for rank, (g, at, a, b) in enumerate(sorted(gaps, reverse=True)[:25])]
    return {"busy_s": busy / 1e9, "wall_s": wall, "first_to_last_kernel_s": window,
            "busy_fraction": busy / 1e9 / wall if wall else 0.0, "top_kernels": kernels,
            "idle_ms_in_gaps": idle, "largest_gaps": largest}


# -------------------------------------------------------------------------------------------------- derived
def decode_roofline(model_cfg: Any, rows: int, prompt_len: int, new_tokens: int, bw: float) -> dict[str, float]:
    """Tokens/s bound of decode at `bw`: each step reads every matmul weight once (bf16) plus the KV of each
    row's context (mean context P + R/2, as a perfect engine would)."""
    from hybridflow.engine.flops import matmul_params

    c = model_cfg
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    weight_bytes = 2 * matmul_params(c, with_lm_head=True)
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2
    kv_bytes = rows * (prompt_len + new_tokens / 2) * kv_per_token
    step_s = (weight_bytes + kv_bytes) / bw
    return {"weight_bytes": weight_bytes, "kv_bytes_mean": kv_bytes, "roofline_tok_s": rows / step_s}


def track_generate_peak(trainer: Any, dev: torch.device) -> None:
    """Make each step's metrics carry `perf/gen_peak_memory_gb`, the peak allocated during generation (CUDA)."""
    orig_generate = trainer.algorithm.generate

    def generate_with_peak(batch: DataProto, metrics: dict[str, float]) -> DataProto:
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        out = orig_generate(batch, metrics)
        if dev.type == "cuda":
            metrics["perf/gen_peak_memory_gb"] = torch.cuda.max_memory_allocated() / 2**30
        return out

    trainer.algorithm.generate = generate_with_peak


STAGE_METHODS = {"generate": ("ActorRolloutRefWorker", "generate_sequences"),
                 "old_log_prob": ("ActorRolloutRefWorker", "compute_log_prob"),
                 "ref": ("ActorRolloutRefWorker", "compute_ref_log_prob"),
                 "update_actor": ("ActorRolloutRefWorker", "update_actor"),
                 "values": ("CriticWorker", "compute_values"),
                 "update_critic": ("CriticWorker", "update_critic")}


def track_stage_peaks(dev: torch.device) -> dict[str, float]:
    """Patch the workers' stage methods (in-process local backend) so that each call records the peak GPU memory
    allocated during it; returns the dict they fill, `perf/peak_gb/<stage>` → GiB (the latest call's)."""
    from hybridflow.workers.actor_rollout_ref import ActorRolloutRefWorker
    from hybridflow.workers.critic import CriticWorker

    peaks: dict[str, float] = {}
    if dev.type != "cuda":
        return peaks
    classes = {"ActorRolloutRefWorker": ActorRolloutRefWorker, "CriticWorker": CriticWorker}
    for stage, (cls_name, meth) in STAGE_METHODS.items():
        cls = classes[cls_name]
        orig = getattr(cls, meth)

        @functools.wraps(orig)  # keeps the @register spec and the signature the group handles check
        def wrapped(self: Any, *a: Any, _orig: Any = orig, _stage: str = stage, **kw: Any) -> Any:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            try:
                return _orig(self, *a, **kw)
            finally:
                torch.cuda.synchronize()
                peaks[f"perf/peak_gb/{_stage}"] = torch.cuda.max_memory_allocated() / 2**30

        setattr(cls, meth, wrapped)
    return peaks


def run_preset(args: argparse.Namespace, preset: str, ceilings: dict[str, float]) -> dict[str, Any]:
    from hybridflow.trainer.ppo import PPOTrainer
    from hybridflow.utils.threads import apply_cpu_threads

    cfg = bench_config(args, preset)
    threads = apply_cpu_threads(cfg.trainer.cpu_threads, cfg.trainer.device)  # what `hybridflow train` does
    dev = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    stage_peaks = track_stage_peaks(dev) if getattr(args, "stage_peaks", False) else {}
    t0 = time.perf_counter()
    trainer = PPOTrainer(cfg)
    startup = time.perf_counter() - t0
    from hybridflow.models.presets import preset_config

    model_cfg = preset_config(preset)
    vocab = model_cfg.vocab_size
    steps: list[dict[str, float]] = []
    track_generate_peak(trainer, dev)
    try:
        for i in range(args.warmup + args.steps):
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            trainer.global_step += 1
            m = trainer.step(synthetic_batch(args.prompts, args.prompt_len, vocab, i))
            if dev.type == "cuda":  # (with --stage-peaks each stage resets the peak: the step's is their largest)
                m |= stage_peaks
                m["perf/step_peak_memory_gb"] = max([torch.cuda.max_memory_allocated() / 2**30,
                                                     *stage_peaks.values()])
            log.info("%s step %d: %.3fs (%s)", preset, i, m["timing/step"],
                     ", ".join(f"{k[7:]}={v:.3f}" for k, v in m.items() if k.startswith("timing/")))
            if i >= args.warmup:
                steps.append(m)
        prof = None
        if args.profile and dev.type == "cuda":
            trainer.global_step += 1
            prof = busy_fraction(trainer, synthetic_batch(args.prompts, args.prompt_len, vocab, 999))
    finally:
        trainer.close()
    med = harness.summarize(steps)
    rows, R = args.prompts * args.n, args.response_len
    gen_s = med.get("timing/generate", med["timing/gen"])
    res: dict[str, Any] = {
        "preset": preset, "startup_s": startup, "steps": steps, "median": med, "profile": prof, "cpu_threads": threads,
        "step_s": med["timing/step"],
        "tokens_per_s": rows * (args.prompt_len + R) / med["timing/step"],
        "decode_tok_s": rows * R / gen_s,
        "update_mfu": med.get("actor/mfu"),
        "switch_s": med.get("timing/switch"),
        "peak_memory_gb": med.get("perf/step_peak_memory_gb"),
        "gen_peak_memory_gb": med.get("perf/gen_peak_memory_gb"),
    }
    if ceilings:
        roof = decode_roofline(model_cfg, rows, args.prompt_len, R, ceilings["hbm_bytes_per_s"])
        res["decode_roofline"] = roof
        res["decode_pct_roofline"] = 100 * res["decode_tok_s"] / roof["roofline_tok_s"]
        if res["update_mfu"] is not None:  # engine MFU is against 989 TFLOP/s; also against the measured rate
            res["update_mfu_vs_measured"] = res["update_mfu"] * 989e12 / ceilings["bf16_flops_per_s"]
    del trainer
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


# ----------------------------------------------------------------------------------------------------- main
def trl_step(out: Path, preset: str) -> float | None:
    """Median TRL step time from `benchmarks/trl_grpo.py`'s JSON in the same output directory, if it ran first."""
    path = out / f"trl_{preset}.json"
    return json.loads(path.read_text()).get("median_step_s") if path.exists() else None


def markdown(env: dict[str, str], ceilings: dict[str, float], results: list[dict[str, Any]]) -> str:
    tag = f" [{env['tag']}]" if env.get("tag") else ""
    lines = [f"GRPO step loop{tag} — {env['date']}, commit {env['commit']}, {env['gpu']}, torch {env['torch']}",
             f"overrides: {env.get('overrides') or 'none'}"]
    lines += [f"{r['preset']}: {r['cpu_threads']}" for r in results if r.get("cpu_threads")]
    if ceilings:
        lines.append(f"measured: copy {ceilings['hbm_bytes_per_s'] / 1e12:.2f} TB/s, "
                     f"bf16 matmul {ceilings['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s")
    stages = ["gen", "generate", "switch", "rollout_graph_capture", "rollout_cache_alloc", "reward", "old_log_prob",
              "adv", "update_actor", "step"]
    lines += ["", "| preset | " + " | ".join(f"timing/{s} (s)" for s in stages)
              + " | tokens/s | decode tok/s | decode % roofline | update MFU | GPU busy | peak GB | gen peak GB"
              + " | TRL step (s; HF generate, no vLLM) | speed-up vs TRL (HF generate, no vLLM) |",
              "|" + "---|" * (len(stages) + 10)]
    for r in results:
        med = r["median"]
        busy = r["profile"]["busy_fraction"] if r.get("profile") else None
        lines.append(f"| {r['preset']} | " + " | ".join(cell(med.get(f"timing/{s}")) for s in stages)
                     + f" | {cell(r['tokens_per_s'], '{:.0f}')} | {cell(r['decode_tok_s'], '{:.0f}')}"
                     + f" | {cell(r.get('decode_pct_roofline'), '{:.1f}')} | {cell(r['update_mfu'], '{:.1%}')}"
                     + f" | {cell(busy, '{:.1%}')} | {cell(r['peak_memory_gb'], '{:.1f}')}"
                     + f" | {cell(r['gen_peak_memory_gb'], '{:.1f}')} | {cell(r.get('trl_step_s'), '{:.2f}')}"
                     + f" | {cell(r.get('speedup_vs_trl'), '{:.1f}x')} |")
    for r in results:
        if r.get("profile"):
            lines += ["", f"top kernels over one {r['preset']} step (ms, calls):"]
            lines += [f"- {k['ms']:.1f} ms x{k['calls']}: {k['name']}" for k in r["profile"]["top_kernels"][:20]]
            idle = ", ".join(f"{k}: {v:.1f} ms" for k, v in r["profile"].get("idle_ms_in_gaps", {}).items())
            lines += ["", f"GPU idle in gaps between kernels ({idle}); largest gaps:"]
            for g in r["profile"].get("largest_gaps", [])[:12]:
                lines.append(f"- {g['idle_ms']:.2f} ms at {g['at_ms']:.1f} ms, after {g['after']} / before {g['before']}")
                if g.get("stages") or g.get("host"):
                    lines.append(f"  - host meanwhile: stages {g.get('stages')}; ranges {g.get('host')}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", choices=["gpu", "custom"], default="custom",
                    help="gpu = qwen2.5-0.5b and 1.5b on cuda with profiling; custom = the flags below")
    ap.add_argument("--preset", action="append", help="model preset(s); repeatable (default per suite)")
    harness.add_workload_args(ap)
    ap.add_argument("--steps", type=int, default=3, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--profile", action=argparse.BooleanOptionalAction, default=None)
    harness.add_override_arg(ap, "extra a.b=c config override; repeatable")
    ap.add_argument("--stage-peaks", action="store_true",
                    help="record each stage's peak GPU memory (perf/peak_gb/<stage>; syncs the GPU at stage edges)")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--tag", default="", help="variant name: in the file names and the table title")
    ap.add_argument("--tuned", action=argparse.BooleanOptionalAction, default=None,
                    help="apply TUNED_* overrides (default: on for --suite gpu)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    presets = args.preset or (["qwen2.5-0.5b", "qwen2.5-1.5b"] if args.suite == "gpu" else ["tiny"])
    if args.profile is None:
        args.profile = args.device != "cpu"
    if args.tuned is None:
        args.tuned = args.suite == "gpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tuned = sorted({o for p in presets for o in tuned_overrides(p)}) if args.tuned else []
    env = harness.environment() | {"tag": args.tag, "overrides": " ".join(tuned + args.override)}
    dev = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    ceilings = measure_ceilings(dev)
    results = []
    for preset in presets:
        r = run_preset(args, preset, ceilings)
        r["trl_step_s"] = trl_step(out, preset)
        r["speedup_vs_trl"] = r["trl_step_s"] / r["step_s"] if r["trl_step_s"] else None
        results.append(r)
        name = f"bench_{preset}_{args.tag}" if args.tag else f"bench_{preset}"
        harness.write_json(out / f"{name}.json", {"env": env, "ceilings": ceilings, "args": vars(args), "result": r})
    harness.write_table(out / "bench.md", markdown(env, ceilings, results))


if __name__ == "__main__":
    main()
