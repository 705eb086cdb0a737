"""The three `trainer.mode`s side by side on the quickstart task from the committed SFT checkpoint.

    python -m benchmarks.async_modes [--steps 10] [--modes sync,one_step_off,async] [a.b=c ...]

Per mode: validation accuracy at the start and end, median step time, and the non-sync metrics (staleness,
`timing/wait_*`, `timing/weight_sync`, bytes, the transport and broadcast times); after the run the rollout workers' weights are compared with the
trainer's (they must be equal). Prints one JSON line per mode. A functional check on any device (`trainer.device`);
on one GPU with the local backend both worker groups share it in one process (no overlap).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SFT_CHECKPOINT = ROOT / "tests" / "assets" / "sft_arithmetic"
KEYS = ("staleness/mean", "staleness/max", "timing/wait_rollout", "timing/wait_train", "timing/weight_sync",
        "weight_sync/bytes", "weight_sync/buckets", "weight_sync/collective", "weight_sync/broadcast_s",
        "weight_sync/rollout_recv_s", "timing/generate", "timing/update_actor")


def run_mode(mode: str, steps: int, overrides: list[str], work: Path) -> dict[str, Any]:
    import torch

    from hybridflow.commands.quickstart import QUICKSTART_YAML
    from hybridflow.config import load_config
    from hybridflow.trainer.ppo import PPOTrainer

    cfg = load_config([QUICKSTART_YAML], [
        f"trainer.run_dir={work}/{mode}/run", f"trainer.default_local_dir={work}/{mode}/ckpt", "trainer.logger=[]",
        f"model.path={SFT_CHECKPOINT}", f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}",
        f"trainer.mode={mode}", *overrides])
    start = time.perf_counter()
    trainer = PPOTrainer(cfg)
    equal: bool | None = None
    try:
        history = trainer.fit()
        if trainer.groups.rollout is not None:
            sent = {n: t for b in trainer.actor.weight_buckets(1 << 40)[0] for n, t in b.tensors()}
            held = trainer.groups.rollout.weights()[0]
            equal = sent.keys() == held.keys() and all(torch.equal(held[n], t) for n, t in sent.items())
    finally:
        trainer.close()
    acc = [m["val/accuracy"] for m in history if "val/accuracy" in m]
    rows = [m for m in history if m.get("training/global_step", 0) >= 1 and "timing/step" in m]
    out: dict[str, Any] = {"mode": mode, "device": cfg.trainer.device, "steps": len(rows),
                           "val_accuracy": [round(a, 4) for a in acc],
                           "step_s_median": statistics.median(m["timing/step"] for m in rows),
                           "wall_s": time.perf_counter() - start, "rollout_weights_equal": equal}
    for key in KEYS:
        vals = [m[key] for m in rows if key in m]
        if vals:
            out[key] = {"median": statistics.median(vals), "max": max(vals)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--modes", default="sync,one_step_off,async")
    parser.add_argument("overrides", nargs="*", metavar="a.b=c")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            print(json.dumps(run_mode(mode, args.steps, args.overrides, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
