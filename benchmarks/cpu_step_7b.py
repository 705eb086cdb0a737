"""Full fine-tuning GRPO at the Qwen2.5-7B shape on one GPU, with a reference model and the KL loss, the optimizer
step on the CPU (`actor.fsdp.optimizer_offload=cpu_step`: fp32 master weights and Adam state in host memory).

One H200 (≤ 10 min):  PYTHONPATH=. python3 -m benchmarks.cpu_step_7b --out $OUT
CPU smoke test (tiny shapes, the same code path):  PYTHONPATH=. python3 -m benchmarks.cpu_step_7b --smoke --out D

Workload (`benchmarks/run.py`'s): random-init bf16 shapes from the preset (no downloads), 32 prompts × 8 samples,
256 random prompt tokens + 256 response tokens (ignore_eos), one optimizer step per generation batch; here with the
KL loss on (`actor.use_kl_loss=true`: a bf16 reference model scores every batch) and the 7B set-up of
`benchmarks/lora_gpu.py` (gradient checkpointing, token-budget micro-batches, one gradient reduction per
mini-batch). `--warmup` untimed steps, then `--steps` timed ones. Printed last and written to
<out>/cpu_step_7b.json, after every step (an OOM keeps the steps before it): per-step `timing/*` stages, the host
optimizer step's own time, peak GPU memory (allocated, reserved) and host memory (this process's peak and current
RSS, the machine's lowest available memory).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as hybridflow/cli.py: before torch loads its OpenMP runtime

import argparse
import functools
import json
import logging
import resource
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.lora_gpu import SEVEN_B, TUNED
from benchmarks.run import bench_overrides, synthetic_batch, track_stage_peaks
from hybridflow.engine import host_optim

log = logging.getLogger("bench.cpu_step_7b")
SETTINGS = (*SEVEN_B, *TUNED, "actor.fsdp.optimizer_offload=cpu_step", "actor.use_kl_loss=true",
            "ref.fsdp.param_dtype=bfloat16")  # the frozen reference needs no fp32 copy
SMOKE = dict(preset="tiny", device="cpu", prompts=4, n=2, prompt_len=16, response_len=8, warmup=1, steps=3)


def host_memory() -> dict[str, float]:
    """This process's current and peak resident memory, the machine's available memory (GB)."""
    fields = {}
    for path, keys in (("/proc/self/status", ("VmRSS", "VmHWM")), ("/proc/meminfo", ("MemAvailable", "MemTotal"))):
        if os.path.exists(path):
            for line in Path(path).read_text().splitlines():
                key, _, value = line.partition(":")
                if key in keys:
                    fields[key] = int(value.split()[0]) / 2**20  # kB → GB
    if "VmHWM" not in fields:
        fields["VmHWM"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"host_rss_gb": fields.get("VmRSS", 0.0), "host_peak_rss_gb": fields["VmHWM"],
            "host_available_gb": fields.get("MemAvailable", 0.0), "host_total_gb": fields.get("MemTotal", 0.0)}


def time_host_steps(cuda: bool) -> dict[str, Any]:
    """Record every host optimizer step's wall time (and the master copies' size) in the returned dict."""
    record: dict[str, Any] = {"seconds": []}
    step = host_optim.HostOptimizer.step

    def timed(self: host_optim.HostOptimizer, *args: Any, **kwargs: Any) -> None:
        record["params"] = sum(m.numel() for m in self.masters)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        try:
            step(self, *args, **kwargs)
        finally:
            if cuda:
                torch.cuda.synchronize()
            record["seconds"].append(time.perf_counter() - t0)

    host_optim.HostOptimizer.step = timed
    return record


def run(args: argparse.Namespace, save: Any) -> dict[str, Any]:
    from hybridflow.config import load_config
    from hybridflow.models.presets import preset_config
    from hybridflow.trainer.ppo import PPOTrainer
    from hybridflow.utils.threads import apply_cpu_threads

    critic = critic_overrides(args)
    ns = argparse.Namespace(device=args.device, tuned=False, override=[*SETTINGS, *critic, *args.override],
                            prompts=args.prompts, n=args.n, prompt_len=args.prompt_len, response_len=args.response_len)
    cfg = load_config(overrides=bench_overrides(ns, args.preset))
    threads = apply_cpu_threads(cfg.trainer.cpu_threads, cfg.trainer.device)  # what `hybridflow train` does
    cuda = args.device != "cpu" and torch.cuda.is_available()
    host_steps = time_host_steps(cuda)
    stage_peaks = track_stage_peaks(torch.device("cuda" if cuda else "cpu"))
    t0 = time.perf_counter()
    trainer = PPOTrainer(cfg)
    res: dict[str, Any] = {"preset": args.preset, "workload": {k: getattr(args, k) for k in
                                                               ("prompts", "n", "prompt_len", "response_len")},
                           "overrides": ns.override, "cpu_threads": threads, "host_step_threads":
                           host_optim.host_cores() if cuda else torch.get_num_threads(),
                           "startup_s": time.perf_counter() - t0, "after_build": host_memory(), "steps": []}
    if cuda:
        res["after_build"] |= {"gpu_allocated_gb": torch.cuda.memory_allocated() / 2**30,
                               "gpu_peak_gb": torch.cuda.max_memory_allocated() / 2**30}
    save(res)
    vocab = preset_config(args.preset).vocab_size
    try:
        for i in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            trainer.global_step += 1
            m = trainer.step(synthetic_batch(args.prompts, args.prompt_len, vocab, i))
            row = {k: v for k, v in m.items() if k.startswith(("timing/", "perf/", "actor/"))}
            row |= host_memory() | {"timed": i >= args.warmup, "host_step_s": sum(host_steps["seconds"])}
            host_steps["seconds"].clear()
            if cuda:  # the stage trackers reset the peak at each stage: the step's is the largest of them
                row |= dict(stage_peaks)
                row |= {"gpu_peak_gb": max([torch.cuda.max_memory_allocated() / 2**30, *stage_peaks.values()]),
                        "gpu_peak_reserved_gb": torch.cuda.max_memory_reserved() / 2**30,
                        "gpu_after_step_gb": torch.cuda.memory_allocated() / 2**30}
            res["steps"].append(row)
            log.info("step %d: %.2fs (host step %.2fs), GPU peak %.1f GB, host RSS peak %.1f GB", i,
                     m["timing/step"], row["host_step_s"], row.get("gpu_peak_gb", 0.0), row["host_peak_rss_gb"])
            save(res)
    finally:
        trainer.close()
    timed = [s for s in res["steps"] if s["timed"]]
    res["trained_params"] = host_steps.get("params")
    res["median"] = harness.summarize([{k: v for k, v in s.items() if not isinstance(v, bool)} for s in timed])
    res["max"] = {k: max(s.get(k, 0.0) for s in res["steps"])
                  for k in ("gpu_peak_gb", "gpu_peak_reserved_gb", "host_peak_rss_gb") if k in res["steps"][0]}
    res["min_host_available_gb"] = min(s["host_available_gb"] for s in res["steps"])
    return res


def critic_overrides(args: argparse.Namespace) -> list[str]:
    """PPO with a critic of another size (`--critic-preset`): a random-init model directory of that shape with the
    actor's vocabulary (the critic reads the actor's token ids), written once under `--out`, and GAE."""
    if not args.critic_preset:
        return []
    from transformers import AutoModelForCausalLM

    from hybridflow.models.presets import preset_config

    path = Path(args.out) / f"critic_{args.critic_preset}"
    if not (path / "config.json").exists():
        hf_cfg = preset_config(args.critic_preset, vocab_size=preset_config(args.preset).vocab_size)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.bfloat16)
        model.save_pretrained(path)
        del model
    return ["algorithm.adv_estimator=gae", f"critic.model_path={path}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--preset", default="qwen2.5-7b")
    harness.add_workload_args(ap)
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first (compilation, CUDA graphs)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps")
    harness.add_override_arg(ap, "a.b=c, after this benchmark's; repeatable")
    ap.add_argument("--critic-preset", default=None, help="PPO with a critic of this preset's shape (GAE)")
    ap.add_argument("--name", default="cpu_step_7b", help="the JSON file's name, <out>/<name>.json")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (checks the code path)")
    args = ap.parse_args()
    harness.apply_smoke(args, SMOKE)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    save = functools.partial(harness.write_json, Path(args.out) / f"{args.name}.json")
    res = run(args, save)
    save(res)
    print(json.dumps({k: res[k] for k in ("preset", "workload", "trained_params", "startup_s", "after_build",
                                          "median", "max", "min_host_available_gb")}, indent=1, default=str))


if __name__ == "__main__":
    main()
