"""Two-GPU benchmark: the GRPO step loop on the Ray backend on 1 vs N GPUs with the same global batch,
PPO with a critic and a larger shape on N GPUs, the hybrid-engine switch against an all-gather bound, and a kill
test (one rank SIGKILLed mid-step: how long until the driver names it).

GPU (2×H200, Ray carried as wheels):
    PYTHONPATH=/tmp/site:$PWD python3 -m benchmarks.two_gpu --out $OUT
CPU check (2 gloo ranks on Ray, tiny model, seconds per step):
    OMP_NUM_THREADS=1 PYTHONPATH=. python3 -m benchmarks.two_gpu --device cpu --case grpo:tiny:1 \
        --case grpo:tiny:2 --case ppo:tiny:2 --prompts 4 --n 2 --prompt-len 16 --response-len 8 --steps 2 --out /tmp/b2

Workload: `benchmarks/run.py`'s (random-init Qwen2.5 shape, `--prompts` × `--n` samples, `--prompt-len` random prompt
tokens + `--response-len` tokens with ignore_eos, KL off, its `--tuned` overrides), fed to `PPOTrainer.step` with
`trainer.backend=ray`. A case is `ALGO:PRESET:RANKS[:STEPS]` (algo grpo or ppo = GAE with a critic); cases run in
the order given, each with a fresh worker group. Extras, on Ray actor handles (`__ray_call__`, between calls):
per-rank peak GPU memory per step, each rank's pid/GPU/env, an all-gather bandwidth probe plus the switch's own
gather pattern (first multi-rank case), and the kill test (after the timed steps of the last multi-rank case, or
of the case after which `--budget-s` leaves no time for another). Run it with `-m` from the repository root: the
probe functions then travel by value, and the Ray workers need the repository on PYTHONPATH (absolute) anyway.
Output: `<out>/two_gpu.json` (rewritten after every case, so a cut-off run keeps what it finished) and
`<out>/two_gpu.md`; the markdown is printed last.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.harness import cell
from benchmarks.run import BENCH_SOURCE, bench_config, bench_overrides, synthetic_batch, tuned_overrides

log = logging.getLogger("bench.two_gpu")

NVLINK_NOMINAL_BYTES_PER_S = 450e9  # H200 NVLink 4: 900 GB/s bidirectional = 450 GB/s each way per GPU
ALIASES = {"0.5b": "qwen2.5-0.5b", "1.5b": "qwen2.5-1.5b", "7b": "qwen2.5-7b"}
DEFAULT_CASES = ["grpo:qwen2.5-0.5b:1", "grpo:qwen2.5-0.5b:2", "ppo:qwen2.5-0.5b:2", "grpo:qwen2.5-1.5b:2"]
STAGES = ["gen", "generate", "switch", "reward", "old_log_prob", "values", "adv", "update_critic", "update_actor",
          "step"]


# ------------------------------------------------------------------------------- run on the worker (Ray actor)
# Each function gets the `WorkerHost` actor instance first (Ray's `__ray_call__`); they run between group calls.
def _rank_info(host: Any, reset_peak: bool) -> dict[str, Any]:
    """pid, device, the multicast-off env as the worker sees it, and peak GPU memory since the last reset."""
    import os
    import socket

    import torch
    import torch.distributed

    from hybridflow.controller.worker import WORKER_BASE_ENV

    dev = host.worker.device
    out: dict[str, Any] = {"rank": host.rank, "pid": os.getpid(), "host": socket.gethostname(), "device": str(dev),
                           "env": {k: os.environ.get(k) for k in [*WORKER_BASE_ENV, "CUDA_VISIBLE_DEVICES"]}}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        out |= {"gpu": props.name, "gpu_uuid": str(getattr(props, "uuid", "")),
                "max_allocated_gb": torch.cuda.max_memory_allocated(dev) / 2**30,
                "max_reserved_gb": torch.cuda.max_memory_reserved(dev) / 2**30,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else ""}
        if reset_peak:
            torch.cuda.reset_peak_memory_stats(dev)
    return out


def _actor_role(host: Any) -> Any:
    """The actor/rollout/ref worker inside a host: a role of the colocated worker, or the worker itself (split)."""
    roles = getattr(host.worker, "roles", None)
    return roles["actor_rollout_ref"] if roles else host.worker


def _noop(host: Any) -> int:
    return host.rank


def _profile_start(host: Any) -> None:
    """Start recording this rank's GPU kernels (one step, stopped by `_profile_stop`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if host.worker.device.type != "cuda":
        host._bench_profile = None
        return
    torch.cuda.synchronize(host.worker.device)
    host._bench_profile = profile(activities=[ProfilerActivity.CUDA])
    host._bench_profile.__enter__()


def _profile_stop(host: Any) -> dict[str, Any]:
    """This rank's GPU-busy seconds over the profiled step (union of kernel/copy intervals); None without a GPU."""
    import torch

    from benchmarks.run import busy_spans

    prof = getattr(host, "_bench_profile", None)
    if prof is None:
        return {"rank": host.rank, "busy_s": None}
    torch.cuda.synchronize(host.worker.device)
    prof.__exit__(None, None, None)
    host._bench_profile = None
    busy_ns, _, first, last = busy_spans(prof)
    return {"rank": host.rank, "busy_s": busy_ns / 1e9, "first_to_last_kernel_s": (last - first) / 1e9}


def _actor_params(host: Any) -> dict[str, Any]:
    """Parameter count of the actor (global, DTensors count whole) and what the generation switch gathers: every
    named parameter, tied ones (embedding = lm_head) once per name, in the parameters' own dtype."""
    module = _actor_role(host).actor.module
    unique = list(module.parameters())
    named = [p for _, p in module.named_parameters(remove_duplicate=False)]
    return {"numel": sum(p.numel() for p in unique), "gathered_numel": sum(p.numel() for p in named),
            "gathered_bytes_own_dtype": sum(p.numel() * p.element_size() for p in named),
            "dtype": str(unique[0].dtype), "tensors": len(named)}


def _collective_probe(host: Any, sizes_mib: list[float], iters: int) -> dict[str, Any]:
    """All ranks at once: all_gather_into_tensor bandwidth per output size, then the switch's gather pattern
    (`full_tensor()` of every actor parameter, one at a time, as `rollout/weights.py` does) timed alone."""
    import time

    import torch
    import torch.distributed as dist

    dev = host.worker.device
    world = dist.get_world_size()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # gloo: no bf16 all-gather

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        dist.barrier()

    gathers = []
    for mib in sizes_mib:
        per_rank = max(1, int(mib * 2**20) // (world * torch.finfo(dtype).bits // 8))
        inp = torch.ones(per_rank, dtype=dtype, device=dev)
        out = torch.empty(per_rank * world, dtype=dtype, device=dev)
        for _ in range(3):
            dist.all_gather_into_tensor(out, inp)
        sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_gather_into_tensor(out, inp)
        sync()
        dt = (time.perf_counter() - t0) / iters
        out_bytes = out.numel() * out.element_size()
        gathers.append({"out_mib": out_bytes / 2**20, "s": dt, "algbw_gb_s": out_bytes / dt / 1e9,
                        "busbw_gb_s": out_bytes * (world - 1) / world / dt / 1e9})
        del inp, out
    from torch.distributed.fsdp import FSDPModule

    module = _actor_role(host).actor.module
    for m in module.modules():  # as WeightView.build: read the shards even where reshard_after_forward=False left none
        if isinstance(m, FSDPModule):
            m.reshard()
    params = [p for _, p in module.named_parameters(remove_duplicate=False)]
    times = []
    with torch.no_grad():
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            for p in params:
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                del full
            sync()
            times.append(time.perf_counter() - t0)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {"world": world, "dtype": str(dtype), "all_gather": gathers, "param_gather_s": sorted(times)[1],
            "param_gather_tensors": len(params)}


# ------------------------------------------------------------------------------------------------- driver side
def parse_case(spec: str, default_steps: int) -> dict[str, Any]:
    """ALGO:PRESET:RANKS[:STEPS][:split] — `split`: one process per role (trainer.use_colocated_worker=false)."""
    parts = spec.split(":")
    split = parts[-1] == "split"
    if split:
        parts = parts[:-1]
    if len(parts) not in (3, 4) or parts[0] not in ("grpo", "ppo"):
        raise SystemExit(f"--case {spec!r}: expected ALGO:PRESET:RANKS[:STEPS][:split] with ALGO grpo|ppo, "
                         f"e.g. grpo:qwen2.5-0.5b:2 or ppo:qwen2.5-1.5b:4:3:split")
    preset = ALIASES.get(parts[1], parts[1])
    return {"algo": parts[0], "preset": preset, "ranks": int(parts[2]),
            "steps": int(parts[3]) if len(parts) == 4 else default_steps, "split": split}


def case_name(c: dict[str, Any]) -> str:
    return f"{c['algo']}:{c['preset']}:{c['ranks']}" + (":split" if c.get("split") else "")


def case_overrides(args: argparse.Namespace, case: dict[str, Any]) -> list[str]:
    ov = ["trainer.backend=ray", f"trainer.n_gpus_per_node={case['ranks']}", "trainer.nnodes=1",
          "trainer.experiment_name=two_gpu"]
    if case.get("split"):  # one process per role on the same GPUs: each asks for 1/roles of a GPU
        ov += ["trainer.use_colocated_worker=false", f"resource_pool.max_colocate_count={2 if case['algo'] == 'ppo' else 1}"]
    if case["algo"] == "ppo":
        ov += ["algorithm.adv_estimator=gae", f"critic.ppo_mini_batch_size={args.prompts}"]
        if args.tuned:  # the critic gets the actor's tuned micro-batch and reshard settings
            micro = [o.split("=", 1)[1] for o in tuned_overrides(case["preset"])
                     if o.startswith("actor.ppo_micro_batch_size_per_gpu=")]
            ov += [f"critic.ppo_micro_batch_size_per_gpu={micro[0]}"] if micro else []
            ov += ["critic.fsdp.reshard_after_forward=false", "critic.fsdp.defer_grad_sync=true"]
    return ov


def case_args(args: argparse.Namespace, case: dict[str, Any]) -> argparse.Namespace:
    """The Namespace `benchmarks.run.bench_config` reads, with this case's overrides after the user's."""
    a = argparse.Namespace(**vars(args))
    a.override = case_overrides(args, case) + list(args.override)
    return a


def host_handles(trainer: Any) -> list[Any]:
    """The actor group's Ray actors (the colocated group's when roles share a process)."""
    return all_handles(trainer)[0]


def all_handles(trainer: Any) -> list[list[Any]]:
    """Each worker group's Ray actors, the actor group first (split runs: actor, then critic)."""
    owners = trainer.groups.owners
    if not owners or owners[0].backend_kind != "ray":
        raise RuntimeError("two_gpu needs trainer.backend=ray (the Ray actor handles carry the probes)")
    return [list(o._handles) for o in owners]


def on_ranks(handles: list[Any], fn: Any, *args: Any, timeout: float = 600.0) -> list[Any]:
    import ray

    return ray.get([h.__ray_call__.remote(fn, *args) for h in handles], timeout=timeout)


def rpc_latency(handles: list[Any], iters: int) -> dict[str, float]:
    """Round trip of an empty Ray actor call to every process at once (what each group call rides on), ms."""
    import ray

    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        ray.get([h.__ray_call__.remote(_noop) for h in handles])
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"p50": times[len(times) // 2], "p90": times[int(len(times) * 0.9)], "iters": iters}


def busy_over_step(trainer: Any, handles: list[Any], batch: Any) -> dict[str, Any]:
    """One more step with every process's GPU kernels recorded: busy seconds per process over the step's wall."""
    on_ranks(handles, _profile_start)
    t0 = time.perf_counter()
    trainer.global_step += 1
    trainer.step(batch)
    wall = time.perf_counter() - t0
    per = on_ranks(handles, _profile_stop)
    fractions = [p["busy_s"] / wall for p in per if p["busy_s"] is not None]
    return {"wall_s": wall, "per_process": per, "busy_fraction_per_process": fractions,
            "busy_fraction_mean": statistics.fmean(fractions) if fractions else None}


def cli_startup(args: argparse.Namespace, case: dict[str, Any]) -> dict[str, Any]:
    """`hybridflow train` for one step as a user would start it (arithmetic task, this case's settings): seconds
    from the process start to the first step's metrics line, minus that step's own time = time to the first
    step. Runs before this driver starts Ray, so the two clusters never share the GPUs."""
    import subprocess
    import sys

    run_dir = Path(args.out) / f"cli_{case_name(case).replace(':', '_')}"
    overrides = [o for o in bench_overrides(case_args(args, case), case["preset"]) if BENCH_SOURCE not in o]
    overrides += ["data.task=arithmetic", "trainer.total_training_steps=1", "trainer.logger=[jsonl]",
                  f"trainer.run_dir={run_dir}", "trainer.project_name=bench", "data.val_size=8"]
    metrics = run_dir / "metrics.jsonl"
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "hybridflow.cli", "train", "--quiet-config", *overrides],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_s = None
    try:
        while proc.poll() is None and time.perf_counter() - t0 < args.cli_timeout_s:
            if first_s is None and metrics.exists() and metrics.read_text().strip():
                first_s = time.perf_counter() - t0
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        out_text = proc.communicate(timeout=60)[0] or ""
    finally:
        if proc.poll() is None:
            proc.kill()
    res: dict[str, Any] = {"case": case_name(case), "rc": proc.returncode, "to_first_metrics_s": first_s,
                           "total_s": time.perf_counter() - t0}
    if metrics.exists() and metrics.read_text().strip():
        first = json.loads(metrics.read_text().splitlines()[0])
        step_s = first.get("timing/step")
        res["first_step_s"] = step_s
        if first_s is not None and step_s is not None:
            res["to_first_step_start_s"] = first_s - step_s
    if proc.returncode != 0:
        res["output_tail"] = out_text[-3000:]
    log.info("cli startup %s: %s", res["case"], {k: v for k, v in res.items() if k != "output_tail"})
    return res


def run_case(args: argparse.Namespace, case: dict[str, Any], *, probe: bool, kill: Any) -> dict[str, Any]:
    """One case on a fresh worker group; `kill()` (asked after the timed steps) says whether to end it with the
    kill test."""
    from hybridflow.models.presets import preset_config
    from hybridflow.trainer.ppo import PPOTrainer

    cfg = bench_config(case_args(args, case), case["preset"])
    vocab = preset_config(case["preset"]).vocab_size
    res: dict[str, Any] = {"case": case_name(case), **case, "overrides": case_overrides(args, case)}
    t0 = time.perf_counter()
    trainer = PPOTrainer(cfg)
    res["startup_s"] = time.perf_counter() - t0
    killed, handles = False, []
    try:
        handles = host_handles(trainer)
        every = [h for group in all_handles(trainer) for h in group]  # split runs: the critic's processes too
        ranks = on_ranks(handles, _rank_info, True)
        res["ranks_info"] = ranks
        res["params"] = on_ranks(handles[:1], _actor_params)[0]
        log.info("%s: %d ranks up in %.1f s: %s", res["case"], len(ranks), res["startup_s"],
                 ", ".join(f"rank {r['rank']} pid {r['pid']} {r['device']} CVD={r['env']['CUDA_VISIBLE_DEVICES']}"
                           for r in ranks))
        steps, peaks = [], []
        for i in range(args.warmup + case["steps"]):
            on_ranks(every, _rank_info, True)  # reset peaks
            trainer.global_step += 1
            m = trainer.step(synthetic_batch(args.prompts, args.prompt_len, vocab, i))
            info = on_ranks(every, _rank_info, False)
            log.info("%s step %d: %.3fs (%s) peak GB %s", res["case"], i, m["timing/step"],
                     ", ".join(f"{k[7:]}={v:.3f}" for k, v in m.items() if k.startswith("timing/")),
                     [round(r.get("max_allocated_gb", 0.0), 1) for r in info])
            if i >= args.warmup:
                steps.append(m)
                peaks.append(info)
        med = harness.summarize(steps)
        rows = args.prompts * args.n
        res |= {"steps": steps, "median": med, "step_s": med["timing/step"],
                "tokens_per_s": rows * (args.prompt_len + args.response_len) / med["timing/step"],
                "decode_tok_s": rows * args.response_len / med.get("timing/generate", med["timing/gen"])}
        if peaks and "max_allocated_gb" in peaks[0][0]:
            res["peak_allocated_gb_per_rank"] = [max(p[r]["max_allocated_gb"] for p in peaks)
                                                 for r in range(len(every))]
            res["peak_reserved_gb_per_rank"] = [max(p[r]["max_reserved_gb"] for p in peaks)
                                                for r in range(len(every))]
            per_gpu: dict[str, float] = {}  # processes sharing a GPU (split roles): the sum of their peaks
            for info, peak in zip(peaks[0], res["peak_allocated_gb_per_rank"]):
                key = info.get("gpu_uuid") or str(info["env"].get("CUDA_VISIBLE_DEVICES"))
                per_gpu[key] = per_gpu.get(key, 0.0) + peak
            res["peak_allocated_gb_per_gpu"] = list(per_gpu.values())
        for role in ("actor", "critic"):  # driver-side stage time minus the workers' own compute time
            stage, own = med.get(f"timing/update_{role}"), med.get(f"{role}/step_time_s")
            if stage is not None and own is not None:
                res[f"update_{role}_outside_compute_s"] = stage - own
        res["rpc_ms"] = rpc_latency(every, args.rpc_iters)
        if args.busy:
            try:  # first run on GPUs pending: a failing profile must not cost the case its timings
                res["busy"] = busy_over_step(trainer, every, synthetic_batch(args.prompts, args.prompt_len, vocab, 99))
                log.info("%s busy: %s", res["case"], res["busy"])
            except Exception as err:  # recorded in the JSON and the log
                res["busy_error"] = f"{type(err).__name__}: {err}"[:2000]
                log.error("%s: busy profile failed: %s", res["case"], res["busy_error"])
        if probe and len(handles) > 1:
            sizes = args.allgather_mib if args.device != "cpu" else [1.0, 8.0]
            res["collectives"] = on_ranks(handles, _collective_probe, sizes, args.allgather_iters)[0]
            log.info("%s collectives: %s", res["case"], res["collectives"])
        if kill():
            killed = True
            res["kill"] = kill_test(args, trainer, handles, ranks, med, vocab)
    except Exception as err:  # keep the other cases; the JSON says what failed
        res["error"] = f"{type(err).__name__}: {err}"[:4000]
        res["traceback"] = traceback.format_exc()[-4000:]
        log.error("%s failed: %s", res["case"], res["error"])
    finally:
        t1 = time.perf_counter()
        try:
            trainer.close()
        except Exception as err:  # a killed group may fail to close cleanly; say so and go on
            res["close_error"] = f"{type(err).__name__}: {err}"[:2000]
        res["close_s"] = time.perf_counter() - t1
        if killed and handles:
            wait_gpus_free(handles)
    return res


def kill_test(args: argparse.Namespace, trainer: Any, handles: list[Any], ranks: list[dict[str, Any]],
              med: dict[str, float], vocab: int) -> dict[str, Any]:
    """SIGKILL the last rank `--kill-frac` of the way into `--kill-stage` of a step; time until the driver raises."""
    from hybridflow.controller.errors import WorkerError

    victim = ranks[-1]
    stage_method = {"update_actor": "update_actor", "gen": "generate_sequences"}[args.kill_stage]
    stage_s = med.get(f"timing/{args.kill_stage}", med["timing/step"])
    delay = max(0.02, args.kill_frac * stage_s)
    view = trainer.actor
    original = getattr(view, stage_method)
    state: dict[str, Any] = {}

    def do_kill() -> None:
        state["t_kill"] = time.perf_counter()
        os.kill(victim["pid"], signal.SIGKILL)

    def wrapped(*a: Any, **k: Any) -> Any:
        if "timer" not in state:
            state["t_call"] = time.perf_counter()
            state["timer"] = threading.Timer(delay, do_kill)
            state["timer"].start()
        return original(*a, **k)

    setattr(view, stage_method, wrapped)
    out: dict[str, Any] = {"stage": args.kill_stage, "delay_s": delay, "victim_rank": victim["rank"],
                           "victim_pid": victim["pid"]}
    try:
        for attempt in range(3):  # the kill may land after the call returned: the next call must then fail
            trainer.global_step += 1
            try:
                trainer.step(synthetic_batch(args.prompts, args.prompt_len, vocab, 100 + attempt))
            except Exception as err:
                t_err = time.perf_counter()
                state["timer"].join()
                text = str(err)
                out |= {"detected": True, "steps_tried": attempt + 1, "error_type": type(err).__name__,
                        "seconds_to_error": t_err - state["t_kill"], "error_text": text[:3000],
                        "error_rank": getattr(err, "rank", None), "error_method": getattr(err, "method", None),
                        "names_dead_rank": isinstance(err, WorkerError) and err.rank == victim["rank"]
                        and f"rank {victim['rank']}" in text}
                log.info("kill test: rank %d (pid %d) killed %.2f s into %s; driver raised %s after %.2f s: %s",
                         victim["rank"], victim["pid"], delay, stage_method, type(err).__name__,
                         out["seconds_to_error"], text.splitlines()[0][:300])
                return out
            state["timer"].join()
        out["detected"] = False
        return out
    finally:
        setattr(view, stage_method, original)


def wait_gpus_free(handles: list[Any], timeout_s: float = 60.0) -> None:
    """After a kill, wait until Ray has reaped the actors (their GPUs are free for the next case)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = 0
        for h in handles:
            try:
                ray.get(h.__ray_ready__.remote(), timeout=1)
                alive += 1
            except Exception:
                pass
        if not alive:
            return
        time.sleep(0.5)


# --------------------------------------------------------------------------------------------------- reporting
def derive(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Scaling (1 rank vs the most ranks, same algo and preset) per stage, and the switch against the bounds."""
    ok = [c for c in cases if "median" in c]
    out: dict[str, Any] = {"scaling": [], "switch": []}
    for c in ok:
        if c["ranks"] == 1:
            continue
        base = next((b for b in ok if b["ranks"] == 1 and b["algo"] == c["algo"] and b["preset"] == c["preset"]), None)
        if base is None:
            continue
        per_stage = {}
        for s in STAGES:
            t1, tn = base["median"].get(f"timing/{s}"), c["median"].get(f"timing/{s}")
            if t1 is not None and tn is not None:
                per_stage[s] = {"t1_s": t1, "tn_s": tn, "ratio": t1 / tn if tn > 0 else None}
        out["scaling"].append({"algo": c["algo"], "preset": c["preset"], "ranks": c["ranks"], "stages": per_stage,
                               "step_ratio": per_stage.get("step", {}).get("ratio"),
                               "efficiency": (per_stage.get("step", {}).get("ratio") or 0.0) / c["ranks"]})
    probe = next((c["collectives"] for c in ok if c.get("collectives")), None)
    big_bw = max((g["busbw_gb_s"] for g in probe["all_gather"]), default=None) if probe else None
    for c in ok:
        p, w = c.get("params"), c["ranks"]
        if not p or w < 2:
            continue
        frac = (w - 1) / w
        bf16 = p["numel"] * 2 * frac
        actual = bf16  # rollout/weights.py unshards each FSDP2 group in its compute dtype: bf16, each tensor once
        sw = c["median"].get("timing/switch")
        row = {"case": c["case"], "switch_s": sw, "param_numel": p["numel"], "param_dtype": p["dtype"],
               "bytes_per_rank_bf16": bf16, "bytes_per_rank_as_gathered": actual,
               "bound_s_bf16_at_450GBs": bf16 / NVLINK_NOMINAL_BYTES_PER_S,
               "bound_s_as_gathered_at_450GBs": actual / NVLINK_NOMINAL_BYTES_PER_S}
        if big_bw:
            row["measured_busbw_gb_s"] = big_bw
            row["bound_s_as_gathered_at_measured"] = actual / (big_bw * 1e9)
            row["bound_s_bf16_at_measured"] = bf16 / (big_bw * 1e9)
        if sw:
            row["effective_gb_s_as_gathered"] = actual / sw / 1e9
        if probe and c.get("collectives") is probe:
            row["param_gather_only_s"] = probe["param_gather_s"]
        out["switch"].append(row)
    return out


def markdown(env: dict[str, Any], args: argparse.Namespace, cases: list[dict[str, Any]],
             derived: dict[str, Any], cli: list[dict[str, Any]] | None = None) -> str:
    dev = next((c["ranks_info"][0].get("gpu") for c in cases if c.get("ranks_info")), None) or env["gpu"]
    lines = [f"Ray backend, 1 vs N ranks — {env['date']}, commit {env['commit']}, {dev}, torch {env['torch']}, "
             f"ray {env.get('ray', '?')}",
             f"workload: {args.prompts} prompts × {args.n}, {args.prompt_len}+{args.response_len} tokens, "
             f"ignore_eos, KL off, {args.warmup} warm-up + median of timed steps; tuned={args.tuned}; "
             f"extra overrides: {' '.join(args.override) or 'none'}", ""]
    stages = [s for s in STAGES if any(f"timing/{s}" in c.get("median", {}) for c in cases)]
    lines += ["| case | ranks | " + " | ".join(f"{s} (s)" for s in stages)
              + " | tokens/s | peak alloc GB per GPU | startup (s) |",
              "|---|---:|" + "---:|" * (len(stages) + 3)]
    for c in cases:
        if "median" not in c:
            lines.append(f"| {c['case']} | {c['ranks']} | failed: {c.get('error', '?')[:200]} |")
            continue
        med = c["median"]
        peaks = "/".join(f"{g:.1f}" for g in c.get("peak_allocated_gb_per_rank", [])) or "-"
        lines.append(f"| {c['case']} | {c['ranks']} | " + " | ".join(cell(med.get(f"timing/{s}")) for s in stages)
                     + f" | {cell(c['tokens_per_s'], '{:.0f}')} | {peaks} | {cell(c.get('startup_s'), '{:.1f}')} |")
    lines += ["", "per case: GPU busy over one extra step (mean over processes), driver→all-processes empty call "
              "(p50 / p90 ms), update stage time outside the workers' own compute (batch delivery + dispatch + "
              "metrics, ms), peak allocated per GPU (processes sharing a GPU summed):", "",
              "| case | GPU busy | RPC p50 / p90 ms | update_actor outside compute ms | update_critic outside compute ms "
              "| peak GB per GPU |", "|---|---:|---:|---:|---:|---:|"]
    for c in cases:
        if "median" not in c:
            continue
        busy = (c.get("busy") or {}).get("busy_fraction_mean")
        rpc = c.get("rpc_ms") or {}
        ms = {k: c.get(f"update_{k}_outside_compute_s") for k in ("actor", "critic")}
        per_gpu = "/".join(f"{g:.1f}" for g in c.get("peak_allocated_gb_per_gpu", [])) or "-"
        lines.append(f"| {c['case']} | {cell(busy, '{:.1%}')} | {cell(rpc.get('p50'), '{:.2f}')} / "
                     f"{cell(rpc.get('p90'), '{:.2f}')} | {cell(ms['actor'] and ms['actor'] * 1e3, '{:.0f}')} | "
                     f"{cell(ms['critic'] and ms['critic'] * 1e3, '{:.0f}')} | {per_gpu} |")
    if cli:
        lines += ["", "`hybridflow train` as a user starts it (arithmetic task, one step): seconds from the process "
                  "start to the first step's start (first metrics line minus that step's time):", "",
                  "| case | to first step start (s) | first step (s) | to first metrics (s) | exit |",
                  "|---|---:|---:|---:|---:|"]
        for r in cli:
            lines.append(f"| {r['case']} | {cell(r.get('to_first_step_start_s'), '{:.1f}')} | "
                         f"{cell(r.get('first_step_s'), '{:.1f}')} | {cell(r.get('to_first_metrics_s'), '{:.1f}')} | "
                         f"{r['rc']} |")
    for sc in derived["scaling"]:
        lines += ["", f"scaling {sc['algo']} {sc['preset']}, 1 → {sc['ranks']} ranks, same global batch "
                  f"(target ≥ 1.8× on the step for 2):", "",
                  "| stage | 1 rank (s) | " + f"{sc['ranks']} ranks (s) | speed-up |", "|---|---:|---:|---:|"]
        for s, v in sc["stages"].items():
            lines.append(f"| {s} | {v['t1_s']:.3f} | {v['tn_s']:.3f} | {cell(v['ratio'], '{:.2f}×')} |")
        ratio = sc["step_ratio"]
        met = "met" if ratio is not None and ratio >= 1.8 else "**missed**"
        lines.append(f"\nstep speed-up {cell(ratio, '{:.2f}×')} ({cell(sc['efficiency'], '{:.0%}')} efficiency): {met}")
    if derived["switch"]:
        bw = next((sw["measured_busbw_gb_s"] for sw in derived["switch"] if sw.get("measured_busbw_gb_s")), None)
        lines += ["", "switch (train → generate → train) against the all-gather it needs; bytes per rank = "
                  "gathered elements × dtype size × (ranks−1)/ranks:", "",
                  "| case | timing/switch (ms) | all-gathered per rank (MB) | bf16 weights once (MB) "
                  "| bound at 450 GB/s, as gathered / bf16 (ms) "
                  + (f"| bound at the measured {bw:.0f} GB/s (ms) " if bw else "")
                  + "| effective GB/s | a full_tensor() per parameter instead (ms) |",
                  "|---|---:|---:|---:|---:|" + ("---:|" if bw else "") + "---:|---:|"]
        for sw in derived["switch"]:
            lines.append(
                f"| {sw['case']} | {cell(sw['switch_s'] and sw['switch_s'] * 1e3, '{:.1f}')} "
                f"| {sw['bytes_per_rank_as_gathered'] / 1e6:.1f} (bf16; master {sw['param_dtype'].replace('torch.', '')}) "
                f"| {sw['bytes_per_rank_bf16'] / 1e6:.1f} "
                f"| {sw['bound_s_as_gathered_at_450GBs'] * 1e3:.2f} / {sw['bound_s_bf16_at_450GBs'] * 1e3:.2f} "
                + (f"| {sw['bound_s_as_gathered_at_measured'] * 1e3:.2f} / {sw['bound_s_bf16_at_measured'] * 1e3:.2f} "
                   if bw else "")
                + f"| {cell(sw.get('effective_gb_s_as_gathered'), '{:.1f}')} "
                f"| {cell(sw.get('param_gather_only_s') and sw['param_gather_only_s'] * 1e3, '{:.1f}')} |")
    probe = next((c["collectives"] for c in cases if c.get("collectives")), None)
    if probe:
        lines += ["", "all_gather_into_tensor (" + probe["dtype"] + "): " + ", ".join(
            f"{g['out_mib']:.0f} MiB out {g['s'] * 1e3:.2f} ms = {g['busbw_gb_s']:.0f} GB/s bus"
            for g in probe["all_gather"])]
    placed = next((c for c in cases if c.get("ranks_info") and c["ranks"] > 1), None)
    if placed:
        lines += ["", f"placement ({placed['case']}): " + "; ".join(
            f"rank {r['rank']} pid {r['pid']} {r['device']} CUDA_VISIBLE_DEVICES={r['env'].get('CUDA_VISIBLE_DEVICES')}"
            + (f" {r['gpu_uuid'][:13]}" if r.get("gpu_uuid") else "") for r in placed["ranks_info"])
            + "; workers' env: " + " ".join(f"{k}={v}" for k, v in placed["ranks_info"][0]["env"].items()
                                            if k != "CUDA_VISIBLE_DEVICES")]
    for c in cases:
        k = c.get("kill")
        if not k:
            continue
        if k.get("detected"):
            first = k["error_text"].splitlines()[0][:400]
            lines += ["", f"kill test ({c['case']}): rank {k['victim_rank']} SIGKILLed {k['delay_s']:.2f} s into "
                      f"{k['stage']}; the driver raised {k['error_type']} after **{k['seconds_to_error']:.2f} s**, "
                      f"naming rank {k['error_rank']} ({'right' if k['names_dead_rank'] else 'WRONG'} rank): "
                      f"`{first}`"]
        else:
            lines += ["", f"kill test ({c['case']}): no error reached the driver in 3 steps (**missed**)"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", action="append", help=f"ALGO:PRESET:RANKS[:STEPS], repeatable, in order (default: "
                    f"{' '.join(DEFAULT_CASES)})")
    harness.add_workload_args(ap)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per case (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--tuned", action=argparse.BooleanOptionalAction, default=True,
                    help="benchmarks.run's TUNED_* overrides (the critic gets the actor's)")
    harness.add_override_arg(ap, "extra a.b=c config override for every case")
    ap.add_argument("--kill-stage", choices=["update_actor", "gen", "none"], default="update_actor")
    ap.add_argument("--kill-frac", type=float, default=0.3, help="kill this fraction into the stage's median time")
    ap.add_argument("--allgather-mib", type=float, nargs="+", default=[4.0, 64.0, 512.0])
    ap.add_argument("--allgather-iters", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="skip the cases that would start after this many seconds (0 = no limit)")
    ap.add_argument("--busy", action=argparse.BooleanOptionalAction, default=True,
                    help="profile one extra step on every process: GPU busy fraction (GPU only)")
    ap.add_argument("--rpc-iters", type=int, default=50, help="empty driver→all-processes calls timed per case")
    ap.add_argument("--cli-startup", action="append", default=[], metavar="CASE",
                    help="before anything else, time `hybridflow train` to its first step for this case; repeatable")
    ap.add_argument("--cli-timeout-s", type=float, default=240.0)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cases = [parse_case(s, args.steps) for s in (args.case or DEFAULT_CASES)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.out = str(out.resolve())
    start = time.perf_counter()
    cli = [cli_startup(args, parse_case(spec, 1)) for spec in args.cli_startup]  # before this driver's Ray

    import ray

    from hybridflow.controller.backends.ray import init_ray

    # Ray's memory monitor kills workers near MemTotal; on the device machines MemTotal starts low and grows.
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")
    ray_kwargs: dict[str, Any] = {}
    if args.device != "cpu" and torch.cuda.is_available():
        ray_kwargs["num_gpus"] = torch.cuda.device_count()
    else:  # CPU check: one logical CPU per process even on a 2-core box (the gloo ranks just share the cores)
        ray_kwargs["num_cpus"] = max(os.cpu_count() or 1, *(c["ranks"] * (2 if c["split"] else 1) for c in cases))
    init_ray(**ray_kwargs)
    env = harness.environment() | {"ray": ray.__version__, "ray_resources": ray.cluster_resources(),
                           "driver_env": {k: os.environ.get(k) for k in
                                          ["NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                           "NVSHMEM_DISABLE_NVLS", "CUDA_VISIBLE_DEVICES"]}}
    log.info("Ray %s, resources %s", ray.__version__, env["ray_resources"])
    multi = [i for i, c in enumerate(cases) if c["ranks"] > 1]
    probe_at = multi[0] if multi else None
    results: list[dict[str, Any]] = []
    durations: list[float] = []

    def no_time_for_another() -> bool:
        return bool(args.budget_s) and (time.perf_counter() - start + (max(durations) if durations else 0.0)
                                        > args.budget_s)

    def kill_decider(i: int):  # the last multi-rank case, or an earlier one when the budget ends the run there
        return lambda: (args.kill_stage != "none" and cases[i]["ranks"] > 1
                        and not any("kill" in r for r in results)
                        and (i == multi[-1] or no_time_for_another()))

    try:
        for i, case in enumerate(cases):
            if no_time_for_another():
                log.warning("skipping %s: %.0f s elapsed, budget %.0f s", case_name(case),
                            time.perf_counter() - start, args.budget_s)
                results.append({"case": case_name(case), **case, "error": "skipped (time budget)"})
                continue
            t0 = time.perf_counter()
            results.append(run_case(args, case, probe=i == probe_at, kill=kill_decider(i)))
            durations.append(time.perf_counter() - t0)
            results[-1]["case_wall_s"] = durations[-1]
            derived = derive(results)
            harness.write_json(out / "two_gpu.json", {"env": env, "args": vars(args), "cli_startup": cli, "cases": results,
                                              "derived": derived})
    finally:
        ray.shutdown()
    derived = derive(results)
    harness.write_table(out / "two_gpu.md", markdown(env, args, results, derived, cli), append=False)
    log.info("total %.1f s", time.perf_counter() - start)


if __name__ == "__main__":
    main()
