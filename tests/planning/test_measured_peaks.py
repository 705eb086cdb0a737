"""The planner's predicted stage peaks against GPU peaks measured on one H200 (tests/planning/measured_peaks.yaml):
each within ±10%, fed the exact settings of the benchmark that measured it."""

import argparse
from pathlib import Path

import pytest
import yaml

from benchmarks import cpu_step_7b, lora_gpu
from benchmarks.run import bench_overrides
from hybridflow.planning.from_config import load_for_gpu, plan_inputs
from hybridflow.planning.memory import GiB, plan_memory

H200_GIB = 139.7
SETTINGS = {"lora_gpu": (*lora_gpu.SEVEN_B, *lora_gpu.TUNED, *lora_gpu.KEEP_RESIDENT),
            "lora_gpu_offload": (*lora_gpu.SEVEN_B, *lora_gpu.TUNED), "cpu_step_7b": cpu_step_7b.SETTINGS,
            "none": ()}
ROWS = yaml.safe_load((Path(__file__).parent / "measured_peaks.yaml").read_text())


def predicted_gib(row: dict) -> float:
    ns = argparse.Namespace(device="cuda", tuned=row.get("tuned", False), prompts=row.get("prompts", 32), n=8,
                            override=[*SETTINGS[row["settings"]], *row["overrides"]], prompt_len=256, response_len=256)
    cfg = load_for_gpu([], bench_overrides(ns, row["preset"]), H200_GIB, row.get("gpus", 1))
    inputs = plan_inputs(cfg)
    plan = plan_memory(inputs.engines, inputs.rollout, int(H200_GIB * GiB), inputs.stages)
    stage = plan.peak if row["stage"] == "peak" else plan.stage(row["stage"])
    return stage.total / GiB


@pytest.mark.parametrize("row", ROWS, ids=[r["name"] for r in ROWS])
def test_predicted_peak_within_10_percent_of_measured(row):
    got = predicted_gib(row)
    assert abs(got / row["measured_gib"] - 1) <= 0.10, f"{row['name']}: predicted {got:.1f} GiB, measured " \
                                                       f"{row['measured_gib']} GiB ({row['source']})"


def test_step_time_seven_b_shape_is_the_preset():
    from hybridflow.models.presets import preset_config
    from hybridflow.planning.model_shape import ModelShape
    from hybridflow.planning.step_time import _seven_b

    assert _seven_b() == ModelShape.from_hf(preset_config("qwen2.5-7b").to_dict())
