"""CPU thread defaults on a busy machine: seconds per SFT step of the quickstart's tiny model.

    python -m benchmarks.cpu_threads [--steps 40]

Two runs of `hybridflow sft` on the quickstart config, each in its own process, while whatever else runs on the
machine keeps running (measure beside a busy process to see the point):
- `before`: what hybridflow did until now — torch's default (one intra-op thread per core) and OpenMP's default
  spin-waiting (`OMP_WAIT_POLICY=ACTIVE`, `trainer.cpu_threads=<cores>`);
- `auto`: the defaults now — `trainer.cpu_threads=0` (the free cores) and a passive wait policy.
Prints cores, load and the median / max `timing/step` of each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

QUICKSTART = Path(__file__).resolve().parents[1] / "hybridflow" / "config" / "quickstart.yaml"


def run(name: str, env_extra: dict[str, str], overrides: list[str], steps: int) -> dict[str, float | str]:
    work = Path(tempfile.mkdtemp(prefix=f"cpu_threads_{name}_"))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env.update(env_extra)
    cmd = [sys.executable, "-m", "hybridflow.cli", "sft", str(QUICKSTART), f"sft.total_steps={steps}",
           f"trainer.run_dir={work}", f"trainer.default_local_dir={work}/ckpt", "trainer.logger=[jsonl]",
           "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.checkpoint.save_freq=0", *overrides]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["timing/step"] for r in rows if "timing/step" in r][2:]  # the first steps warm up
    header = next((line for line in proc.stderr.splitlines() if line.startswith("cpu threads:")), "")
    return {"run": name, "median_s": statistics.median(times), "max_s": max(times), "steps": len(times),
            "header": header}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    print(f"cores {cores}, load {os.getloadavg()[0]:.1f}", flush=True)
    for name, env, over in (("before", {"OMP_WAIT_POLICY": "ACTIVE"}, [f"trainer.cpu_threads={cores}"]),
                            ("auto", {}, [])):
        print(json.dumps(run(name, env, over, args.steps)), flush=True)
    print(f"load after {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
