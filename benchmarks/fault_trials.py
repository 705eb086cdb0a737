"""Fault trials: kill -9 during async checkpoint saves, a Ray worker killed during PPO training, and a
Ray worker that hangs inside a training stage.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.fault_trials --ckpt-trials 16 --ray-trials 3 \
        --hang-trials 3

Checkpoint trial: a child process trains nothing but saves a tiny model + AdamW state (filled with its step's
value) in a loop with `async_save=true` (so a kill usually lands inside a save) and is SIGKILLed at a random moment;
the next trial resumes where the latest complete checkpoint says. Usable = the latest checkpoint exists, is never
older than the previous trial's, and every complete checkpoint loads as exactly its own step's state.

Ray trial: a tiny GRPO run on 2 CPU ranks (gloo); rank 1's process is SIGKILLed `--kill-delay` s into step 2.
Reported: seconds from the kill to the driver's error, whether that error names the dead rank and a training call
(not a cleanup such as `close_checkpoints`), and whether `run_end` in events.jsonl says `failed`.

Async-resume trial: a tiny `trainer.mode=async` run (local backend, max_staleness 1, 8 steps = 2 epochs) is sent
SIGTERM at a random moment after its first step, then the same command resumes it. Usable = exit 143, then every
step trained once and every prompt once per epoch across the two processes, staleness within the bound, and the
first resumed step trains the rollouts generated before the stop (one version old), not regenerated ones.
Hang trial: the same run with `trainer.hang_timeout_s=--hang-timeout`; from step 2 on, rank 1 sleeps for 10 minutes
at the start of `update_actor` (rank 0 waits for it in FSDP's collectives). Reported: seconds from the start of the
sleep to `run_ppo` raising (after its cleanups and `run_end`), less the timeout; whether the `HangError` names
`update_actor` and rank 1, whether rank 1's stack dump names the sleeping function, and whether `run_end` says
`failed`.
Prints a markdown table, then one JSON object; `--out DIR` also writes `fault_trials.json` there.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness import commit, write_json
from hybridflow.checkpoint import CheckpointManager, atomic

# Calls made only while the run shuts down: an error naming one of them hides the call the kill landed in.
# (`poll_checkpoint` is not one: the loop polls the background save after every step, so a kill can land there.)
CLEANUP_METHODS = ("close_checkpoints", "shutdown")


# ------------------------------------------------------------------------------------------- checkpoint trials
def tiny_state(step: int) -> dict[str, Any]:
    """A 2-layer MLP and its AdamW state, every tensor filled from `step` (so a load proves which save it is)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    for state in opt.state.values():
        state["exp_avg"].fill_(-float(step))
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def save_forever(root: str, start: int, started: Any) -> None:
    """Child: async-save step after step until killed."""
    torch.set_num_threads(1)
    mgr = CheckpointManager(root, async_save=True, keep_last_n=3)
    states = {s: tiny_state(s) for s in (start, start + 1)}
    step = start
    # One complete checkpoint before the kill window opens: a kill before any save finished would leave nothing to
    # resume from, and count as "unusable" although nothing broke (it did, under load, once in CI-like runs).
    mgr.save(step, {"actor": states[step]}, extra={"step": step})
    mgr.wait()
    step += 1
    started.set()
    while True:
        state = states.get(step) or tiny_state(step)
        mgr.save(step, {"actor": state}, extra={"step": step})
        step += 1


def check_checkpoints(root: Path) -> tuple[int | None, int]:
    """(latest complete step, complete checkpoints that did not load as their own step's state)."""
    mgr = CheckpointManager(root, async_save=False, capture_rng=False)
    broken = 0
    for step, path in atomic.list_complete(root):
        loaded = mgr.load(path, restore_rng=False).components["actor"]
        ref = tiny_state(step)
        same = loaded["optimizer"]["param_groups"][0]["lr"] == ref["optimizer"]["param_groups"][0]["lr"]
        same &= all(torch.equal(loaded["model"][k], v) for k, v in ref["model"].items())
        same &= all(torch.equal(loaded["optimizer"]["state"][i]["exp_avg"], s["exp_avg"])
                    for i, s in ref["optimizer"]["state"].items())
        broken += not same
    mgr.close()
    latest = atomic.find_latest(root)
    return (None if latest is None else atomic.parse_step(latest.name)), broken


def ckpt_trials(n: int, seed: int, max_delay_s: float) -> dict[str, Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "hybridflow.checkpoint"])
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    latest: int | None = None
    with tempfile.TemporaryDirectory(prefix="fault_ckpt_") as tmp:
        root = Path(tmp)
        for trial in range(n):
            started = ctx.Event()
            proc = ctx.Process(target=save_forever, args=(str(root), (latest or 0) + 1, started))
            proc.start()
            if not started.wait(timeout=120):
                raise RuntimeError("the saving child did not start within 120 s")
            time.sleep(rng.uniform(0.05, max_delay_s))
            os.kill(proc.pid, signal.SIGKILL)
            proc.join()
            names = [p.name for p in root.iterdir()]
            mid_save = any(x.startswith((atomic.TMP_PREFIX, atomic.TRASH_PREFIX)) for x in names)
            new_latest, broken = check_checkpoints(root)
            usable = new_latest is not None and broken == 0 and (latest is None or new_latest >= latest)
            rows.append({"trial": trial, "latest_step": new_latest, "killed_mid_save": mid_save,
                         "broken": broken, "usable": usable})
            latest = new_latest if new_latest is not None else latest
    return {"trials": n, "usable": sum(r["usable"] for r in rows),
            "killed_mid_save": sum(r["killed_mid_save"] for r in rows),
            "broken_checkpoints": sum(r["broken"] for r in rows), "final_step": latest, "rows": rows}


# --------------------------------------------------------------------------------------------------- Ray trials
def _pid(host: Any) -> int:
    return os.getpid()


def _run_with_step(cfg: Any, step: Any, original_step: Any) -> BaseException | None:
    """`run_ppo(cfg)` with `PPOTrainer.step` replaced by `step` (restored after, Ray shut down); the error it
    raised (the trial's subject, recorded by the caller) or None."""
    import ray

    from hybridflow.trainer.ppo import PPOTrainer
    from hybridflow.trainer.run import run_ppo

    PPOTrainer.step = step  # type: ignore[method-assign]
    try:
        run_ppo(cfg)
    except Exception as err:  # noqa: BLE001 - returned to the trial, which records it
        return err
    finally:
        PPOTrainer.step = original_step  # type: ignore[method-assign]
        ray.shutdown()
    return None


def ray_trial(workdir: Path, kill_delay_s: float) -> dict[str, Any]:
    """One tiny GRPO run on 2 Ray CPU ranks with rank 1 SIGKILLed `kill_delay_s` into step 2 (200 steps are
    configured so the kill always lands mid-run: with 4, a fast machine finished before the timer fired)."""
    import ray

    from hybridflow.config import load_config
    from hybridflow.tracking.jsonl import read_events
    from hybridflow.trainer.ppo import PPOTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = load_config(overrides=[
        "trainer.device=cpu", "trainer.backend=ray", "trainer.n_gpus_per_node=2", "trainer.logger=[]",
        "model.override_config={num_hidden_layers: 1}", "data.train_size=16", "data.val_size=2",
        "data.max_response_length=6", "data.train_batch_size=2", "rollout.n=4", "actor.ppo_mini_batch_size=2",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.total_training_steps=200",
        "trainer.checkpoint.save_freq=1", f"trainer.run_dir={workdir}/run", f"trainer.default_local_dir={workdir}/ckpt"])
    state: dict[str, Any] = {}
    original_step = PPOTrainer.step

    def kill(pid: int) -> None:
        state["t_kill"] = time.perf_counter()
        os.kill(pid, signal.SIGKILL)

    def step(self: PPOTrainer, batch: Any) -> dict[str, float]:
        if self.global_step == 2 and "timer" not in state:
            handle = self.groups.owners[0]._handles[1]  # noqa: SLF001 - the trial reaches into the Ray backend
            state["timer"] = threading.Timer(kill_delay_s, kill, (ray.get(handle.__ray_call__.remote(_pid)),))
            state["timer"].start()
        return original_step(self, batch)

    error = _run_with_step(cfg, step, original_step)
    t_error = time.perf_counter()
    ends = [e for e in read_events(workdir / "run") if e["kind"] == "run_end"]
    method = str(getattr(error, "method", ""))
    return {"error_type": type(error).__name__ if error else None, "rank": getattr(error, "rank", None),
            "method": method, "names_dead_rank": getattr(error, "rank", None) == 1,
            "names_training_call": bool(method) and not method.endswith(CLEANUP_METHODS),
            "seconds_to_error": round(t_error - state["t_kill"], 2) if "t_kill" in state else None,
            "run_end": ends[-1]["status"] if ends else None,
            "notes": list(getattr(error, "__notes__", [])), "error_head": str(error).splitlines()[0][:300]}


def hang_trial_sleep(seconds: float) -> None:
    """What rank 1 runs instead of training (its stack dump must name this function)."""
    time.sleep(seconds)


def _sleep_before(host: Any, suffix: str, seconds: float, started: str) -> list[str]:
    """Run inside a worker actor: its methods named `*suffix` first write the wall time to `started` and sleep
    `seconds` (instance attributes win over the class's, and the host calls `getattr(worker, target)`)."""
    worker, names = host.worker, [n for n in dir(type(host.worker)) if n.endswith(suffix)]
    for name in names:
        def sleepy(*args: Any, _original: Any = getattr(worker, name), **kwargs: Any) -> Any:
            Path(started).write_text(str(time.time()))
            hang_trial_sleep(seconds)
            return _original(*args, **kwargs)
        setattr(worker, name, sleepy)
    return names


def hang_trial(workdir: Path, hang_timeout_s: float) -> dict[str, Any]:
    """A tiny GRPO run on 2 Ray CPU ranks whose rank 1 sleeps in `update_actor` from step 2 on."""
    import ray

    from hybridflow.config import load_config
    from hybridflow.controller.errors import HangError
    from hybridflow.tracking.jsonl import read_events
    from hybridflow.trainer.ppo import PPOTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    cfg = load_config(overrides=[
        "trainer.device=cpu", "trainer.backend=ray", "trainer.n_gpus_per_node=2", "trainer.logger=[]",
        "model.override_config={num_hidden_layers: 1}", "data.train_size=16", "data.val_size=2",
        "data.max_response_length=6", "data.train_batch_size=2", "rollout.n=4", "actor.ppo_mini_batch_size=2",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.total_training_steps=20",
        "trainer.checkpoint.save_freq=0", f"trainer.hang_timeout_s={hang_timeout_s}",
        f"trainer.run_dir={workdir}/run", f"trainer.default_local_dir={workdir}/ckpt"])
    state: dict[str, Any] = {}
    original_step = PPOTrainer.step

    def step(self: PPOTrainer, batch: Any) -> dict[str, float]:
        if self.global_step == 2 and "patched" not in state:
            handle = self.groups.owners[0]._handles[1]  # noqa: SLF001 - the trial reaches into the Ray backend
            state["patched"] = ray.get(handle.__ray_call__.remote(_sleep_before, "update_actor", 600.0,
                                                                  str(workdir / "sleep_started")))
        return original_step(self, batch)

    error = _run_with_step(cfg, step, original_step)
    t_error = time.time()
    started = workdir / "sleep_started"
    ends = [e for e in read_events(workdir / "run") if e["kind"] == "run_end"]
    dumps = sorted(p.name for p in (workdir / "run" / "hang").glob("*.txt"))
    rank1 = [p for p in (workdir / "run" / "hang").glob("*.rank1.txt")]
    return {"error_type": type(error).__name__ if error else None, "patched": state.get("patched"),
            "names_stage_and_rank": isinstance(error, HangError) and error.stage == "update_actor"
            and error.rank == 1, "dumps": dumps,
            "dump_names_sleeper": any("hang_trial_sleep" in p.read_text() for p in rank1),
            "seconds_past_timeout": (round(t_error - float(started.read_text()) - hang_timeout_s, 2)
                                     if started.exists() else None),
            "run_end": ends[-1]["status"] if ends else None, "run_end_message": ends[-1]["message"] if ends else None,
            "error_head": str(error).splitlines()[0][:300]}


def _child_trials(n: int, flag: str, value: float, name: str) -> list[dict[str, Any]]:
    """Each trial in a fresh Python process (a fresh Ray cluster); the trial prints its JSON as the last line."""
    rows = []
    for _ in range(n):
        with tempfile.TemporaryDirectory(prefix=f"fault_{name}_") as tmp:
            cmd = [sys.executable, "-m", "benchmarks.fault_trials", f"--{name}-child", tmp, flag, str(value)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            lines = proc.stdout.strip().splitlines()
            if proc.returncode != 0 or not lines:
                raise RuntimeError(f"{name} trial exited {proc.returncode}: {proc.stderr[-3000:]}")
            rows.append(json.loads(lines[-1]))
    return rows


def hang_trials(n: int, hang_timeout_s: float) -> dict[str, Any]:
    rows = _child_trials(n, "--hang-timeout", hang_timeout_s, "hang")
    late = [r["seconds_past_timeout"] for r in rows if r["seconds_past_timeout"] is not None]
    return {"trials": n, "hang_timeout_s": hang_timeout_s,
            "names_stage_and_rank": sum(r["names_stage_and_rank"] for r in rows),
            "dump_names_sleeper": sum(r["dump_names_sleeper"] for r in rows),
            "run_end_failed": sum(r["run_end"] == "failed" for r in rows),
            "seconds_past_timeout_max": max(late) if late else None, "rows": rows}


def ray_trials(n: int, kill_delay_s: float) -> dict[str, Any]:
    rows = _child_trials(n, "--kill-delay", kill_delay_s, "ray")
    times = [r["seconds_to_error"] for r in rows if r["seconds_to_error"] is not None]
    return {"trials": n, "names_dead_rank": sum(r["names_dead_rank"] for r in rows),
            "names_training_call": sum(r["names_training_call"] for r in rows),
            "run_end_failed": sum(r["run_end"] == "failed" for r in rows),
            "seconds_to_error_median": statistics.median(times) if times else None,
            "seconds_to_error_max": max(times) if times else None, "rows": rows}


# ------------------------------------------------------------------------------------------ async-resume trials
def async_child(workdir: Path) -> None:
    """Child: the async run, resumed from `workdir` when it holds a checkpoint; each step's prompts and versions go to
    steps.jsonl as the step starts (a SIGTERM lets the step in flight finish and saves it)."""
    from hybridflow.config import load_config
    from hybridflow.trainer.ppo import PPOAlgorithm
    from hybridflow.trainer.run import run_ppo
    from hybridflow.trainer.stop import Interrupted

    cfg = load_config(overrides=[
        "trainer.device=cpu", "trainer.backend=local", "trainer.mode=async", "trainer.async.max_staleness=1",
        "trainer.async.chunk_prompts=1", "trainer.logger=[]", "model.override_config={num_hidden_layers: 1}",
        "data.train_size=16", "data.val_size=2", "data.max_response_length=6", "data.train_batch_size=4",
        "rollout.n=2", "actor.ppo_mini_batch_size=4", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.total_training_steps=8", "trainer.checkpoint.save_freq=100", "trainer.resume_mode=auto",
        f"trainer.run_dir={workdir}/run", f"trainer.default_local_dir={workdir}/ckpt"])
    step = PPOAlgorithm.step

    def recording(self: PPOAlgorithm, batch: Any, n: int) -> dict[str, float]:
        time.sleep(0.25)  # 8 steps outlast the signal's random delay on a fast, idle box (it must land mid-run)
        with open(workdir / "steps.jsonl", "a") as f:
            f.write(json.dumps({"step": n, "uid": sorted(set(batch.non_tensor_batch["uid"])),
                                "version": batch.batch["policy_version"].tolist()}) + "\n")
        return step(self, batch, n)

    PPOAlgorithm.step = recording  # type: ignore[method-assign]
    try:
        run_ppo(cfg)
    except Interrupted as err:  # the signal's exit code, as `hybridflow train` exits
        sys.exit(err.exit_code)


def async_trials(n: int, seed: int, max_delay_s: float) -> dict[str, Any]:
    rng, rows = random.Random(seed), []
    for trial in range(n):
        with tempfile.TemporaryDirectory(prefix="fault_async_") as tmp:
            cmd, log = [sys.executable, "-m", "benchmarks.fault_trials", "--async-child", tmp], Path(tmp) / "steps.jsonl"
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            while proc.poll() is None and not log.exists():
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, max_delay_s))
            proc.send_signal(signal.SIGTERM)
            first_rc, stopped_after = proc.wait(timeout=600), len(log.read_text().splitlines())
            second = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            steps = [json.loads(line) for line in log.read_text().splitlines()]
            epochs = [[u for s in steps if (s["step"] - 1) // 4 == e for u in s["uid"]] for e in (0, 1)]
            staleness = max((s["step"] - 1) - v for s in steps for v in s["version"])
            resumed = steps[stopped_after] if stopped_after < len(steps) else None  # generated before the stop:
            kept = resumed is not None and min(resumed["version"]) < resumed["step"] - 1  # one version old
            rows.append({"trial": trial, "first_exit": first_rc, "second_exit": second.returncode,
                         "stopped_after_steps": stopped_after, "max_staleness": staleness, "kept_rollouts": kept,
                         "usable": first_rc == 143 and second.returncode == 0 and staleness <= 1 and kept
                         and [s["step"] for s in steps] == list(range(1, 9))
                         and all(len(u) == len(set(u)) == 16 for u in epochs), "stderr_tail": second.stderr[-300:]})
    return {"trials": n, "usable": sum(r["usable"] for r in rows), "rows": rows}


# ----------------------------------------------------------------------------------------------------- report
def markdown(result: dict[str, Any]) -> str:
    lines = ["| trial | trials | usable checkpoints | kills mid-save | error names dead rank + failing call "
             "| run_end failed | time to error (median / max) |", "|---|---:|---:|---:|---:|---:|---:|"]
    c = result.get("checkpoint")
    if c:
        lines.append(f"| kill -9 during async save | {c['trials']} | {c['usable']}/{c['trials']} | "
                     f"{c['killed_mid_save']} | – | – | – |")
    r = result.get("ray")
    if r:
        t = r["seconds_to_error_median"]
        times = "–" if t is None else f"{t:.2f} s / {r['seconds_to_error_max']:.2f} s"
        both = sum(x["names_dead_rank"] and x["names_training_call"] for x in r["rows"])
        lines.append(f"| Ray worker SIGKILL (PPO, 2 gloo ranks) | {r['trials']} | – | – | {both}/{r['trials']} | "
                     f"{r['run_end_failed']}/{r['trials']} | {times} |")
    a = result.get("async")
    if a:
        lines.append(f"| SIGTERM + resume, trainer.mode=async | {a['trials']} | {a['usable']}/{a['trials']} | – | – | "
                     "– | – |")
    h = result.get("hang")
    if h:
        late = h["seconds_past_timeout_max"]
        times = "–" if late is None else f"timeout + {late:.2f} s (max)"
        both = sum(x["names_stage_and_rank"] and x["dump_names_sleeper"] for x in h["rows"])
        lines.append(f"| Ray worker hangs in update_actor (hang_timeout_s={h['hang_timeout_s']:g}) | {h['trials']} | – "
                     f"| – | {both}/{h['trials']} | {h['run_end_failed']}/{h['trials']} | {times} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt-trials", type=int, default=12)
    ap.add_argument("--ray-trials", type=int, default=1, help="0 skips the Ray trial")
    ap.add_argument("--async-trials", type=int, default=0, help="SIGTERM + resume of an async run")
    ap.add_argument("--max-delay", type=float, default=1.0, help="kill the saver up to this many seconds in")
    ap.add_argument("--kill-delay", type=float, default=0.3, help="kill rank 1 this many seconds into step 2")
    ap.add_argument("--hang-trials", type=int, default=1, help="0 skips the hang trial")
    ap.add_argument("--hang-timeout", type=float, default=5.0, help="trainer.hang_timeout_s of the hang trial")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--ray-child", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--async-child", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hang-child", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.ray_child is not None:
        print(json.dumps(ray_trial(args.ray_child, args.kill_delay)), flush=True)
        return
    if args.async_child is not None:
        async_child(args.async_child)
        return
    if args.hang_child is not None:
        print(json.dumps(hang_trial(args.hang_child, args.hang_timeout)), flush=True)
        return
    result: dict[str, Any] = {"env": {"commit": commit() or None, "torch": torch.__version__,
                                      "python": sys.version.split()[0], "cpus": os.cpu_count(),
                                      "date_unix": round(time.time())}}
    if args.ckpt_trials > 0:
        result["checkpoint"] = ckpt_trials(args.ckpt_trials, args.seed, args.max_delay)
    if args.ray_trials > 0:
        result["ray"] = ray_trials(args.ray_trials, args.kill_delay)
    if args.async_trials > 0:
        result["async"] = async_trials(args.async_trials, args.seed, args.max_delay)
    if args.hang_trials > 0:
        result["hang"] = hang_trials(args.hang_trials, args.hang_timeout)
    print(markdown(result))
    print(json.dumps(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "fault_trials.json", result)


if __name__ == "__main__":
    main()
