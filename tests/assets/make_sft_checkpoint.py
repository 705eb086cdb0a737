"""Regenerate a committed SFT warm start, so the RL learning tests start from one fixed checkpoint on every machine
(a failure then names the RL stage, not SFT luck):

    OMP_NUM_THREADS=1 .venv/bin/python tests/assets/make_sft_checkpoint.py                  # sft_arithmetic/
    OMP_NUM_THREADS=1 .venv/bin/python tests/assets/make_sft_checkpoint.py tool_calculator  # sft_tool_calculator/
    OMP_NUM_THREADS=1 .venv/bin/python tests/assets/make_sft_checkpoint.py arithmetic_clean # sft_arithmetic_clean/
    OMP_NUM_THREADS=1 .venv/bin/python tests/assets/make_sft_checkpoint.py arithmetic_moe   # sft_arithmetic_moe/
    OMP_NUM_THREADS=1 .venv/bin/python tests/assets/make_sft_checkpoint.py colour_count     # sft_colour_count/

`arithmetic`: the config of `hybridflow quickstart` (hybridflow/config/quickstart.yaml); `arithmetic_clean`: the same
without label noise (the distillation test's teacher); `arithmetic_moe`: the quickstart on the `tiny-moe` preset (Qwen3-MoE,
8 experts, top-2) at the quickstart's shape; `tool_calculator`: the tool-use recipe
(examples/tool_calculator.yaml); `colour_count`: the vision-language recipe (examples/colour_count.yaml, `tiny-vl`,
images); default seeds. Writes the HF directory and `provenance.json`
(steps, val loss, versions, CPU). Float rounding differs between machines, so a regenerated checkpoint is
equivalent, not bit-identical.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parent
ROOT = ASSETS.parents[1]
QUICKSTART = ROOT / "hybridflow" / "config" / "quickstart.yaml"
RECIPES = {  # name -> (config, asset directory, config as named in provenance.json, overrides)
    "arithmetic": (QUICKSTART, ASSETS / "sft_arithmetic", "hybridflow/config/quickstart.yaml (default seeds)", ()),
    "arithmetic_clean": (QUICKSTART, ASSETS / "sft_arithmetic_clean",
                         "hybridflow/config/quickstart.yaml with sft.label_noise=0 (default seeds)",
                         ("sft.label_noise=0",)),
    "arithmetic_moe": (QUICKSTART, ASSETS / "sft_arithmetic_moe",
                       "hybridflow/config/quickstart.yaml with model.preset=tiny-moe (default seeds)",
                       ("model.preset=tiny-moe",)),
    "tool_calculator": (ROOT / "examples" / "tool_calculator.yaml", ASSETS / "sft_tool_calculator",
                        "examples/tool_calculator.yaml (default seeds)", ()),
    "colour_count": (ROOT / "examples" / "colour_count.yaml", ASSETS / "sft_colour_count",
                     "examples/colour_count.yaml (default seeds)", ()),
}


def main(recipe: str = "arithmetic") -> None:
    import transformers

    from hybridflow.config import load_config
    from hybridflow.tracking import Tracker
    from hybridflow.trainer.sft import run_sft

    config, asset, named, overrides = RECIPES[recipe]
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config([config], [f"trainer.run_dir={tmp}/run", "trainer.logger=[jsonl]", "trainer.test_freq=50",
                                     *overrides])
        with Tracker.from_config(cfg) as tracker:
            out = run_sft(cfg, out_dir=Path(tmp) / "hf", tracker=tracker)
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        val = [r for r in rows if "val/loss" in r]
        if asset.exists():
            shutil.rmtree(asset)
        shutil.copytree(out, asset)
    provenance = {"config": named, "sft_steps": int(val[-1]["training/global_step"]), "val_loss": val[-1]["val/loss"],
                  "target_val_loss": cfg.sft.target_val_loss, "torch": torch.__version__,
                  "transformers": transformers.__version__, "cpu": platform.processor() or platform.machine()}
    (asset / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(provenance))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default="arithmetic", choices=sorted(RECIPES))
    main(parser.parse_args().recipe)
