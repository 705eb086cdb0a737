"""Regenerate `tests/assets/sft_arithmetic/`: the quickstart's SFT warm start (default seeds), committed so the RL
learning tests start from one fixed checkpoint on every machine (a failure then names the RL stage, not SFT luck).

    OMP_NUM_THREADS=1 .venv/bin/python tests/assets/make_sft_checkpoint.py

Same config as `hybridflow quickstart` (hybridflow/config/quickstart.yaml); the SFT stops at `sft.target_val_loss`.
Writes the HF directory and `provenance.json` (steps, val loss, versions, CPU). Float rounding differs between
machines, so a regenerated checkpoint is equivalent, not bit-identical.
"""

from __future__ import annotations

import json
import platform
import shutil
import tempfile
from pathlib import Path

import torch

ASSET = Path(__file__).resolve().parent / "sft_arithmetic"


def main() -> None:
    import transformers

    from hybridflow.commands.quickstart import QUICKSTART_YAML
    from hybridflow.config import load_config
    from hybridflow.tracking import Tracker
    from hybridflow.trainer.sft import run_sft

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config([QUICKSTART_YAML], [f"trainer.run_dir={tmp}/run", "trainer.logger=[jsonl]",
                                              "trainer.test_freq=50"])
        with Tracker.from_config(cfg) as tracker:
            out = run_sft(cfg, out_dir=Path(tmp) / "hf", tracker=tracker)
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        val = [r for r in rows if "val/loss" in r]
        if ASSET.exists():
            shutil.rmtree(ASSET)
        shutil.copytree(out, ASSET)
    provenance = {"config": "hybridflow/config/quickstart.yaml (default seeds)",
                  "sft_steps": int(val[-1]["training/global_step"]), "val_loss": val[-1]["val/loss"],
                  "target_val_loss": cfg.sft.target_val_loss, "torch": torch.__version__,
                  "transformers": transformers.__version__, "cpu": platform.processor() or platform.machine()}
    (ASSET / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(provenance))


if __name__ == "__main__":
    main()
