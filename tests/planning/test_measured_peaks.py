"""The planner's predicted stage peaks and step times against those measured on H200s
(tests/planning/measured_peaks.yaml): peaks within ±10%, steps within ±15%, fed the exact settings of the benchmark
that measured them. Some rows are the step-time constants' own sources (docs/plan.md says which)."""

import argparse
import tempfile
from pathlib import Path

import pytest
import yaml

from benchmarks import cpu_step_7b, lora_gpu
from benchmarks.run import bench_overrides
from hybridflow.planning.from_config import PlanInputs, load_for_gpu, plan_inputs
from hybridflow.planning.memory import GiB, plan_memory
from hybridflow.planning.step_time import GPUS, predict_step_time

H200_GIB = 139.7
SETTINGS = {"lora_gpu": (*lora_gpu.SEVEN_B, *lora_gpu.TUNED, *lora_gpu.KEEP_RESIDENT),
            "lora_gpu_offload": (*lora_gpu.SEVEN_B, *lora_gpu.TUNED), "cpu_step_7b": cpu_step_7b.SETTINGS,
            "none": ()}
ROWS = yaml.safe_load((Path(__file__).parent / "measured_peaks.yaml").read_text())


def _critic_dir(row: dict) -> list[str]:
    """A critic of another shape (`critic_preset`): its config.json (the planner reads shapes only) with the actor's
    vocabulary, as benchmarks/cpu_step_7b.py --critic-preset writes it, and GAE."""
    if "critic_preset" not in row:
        return []
    from hybridflow.models.presets import preset_config

    path = Path(tempfile.mkdtemp(prefix="critic_"))
    preset_config(row["critic_preset"], vocab_size=preset_config(row["preset"]).vocab_size).to_json_file(
        str(path / "config.json"))
    return ["algorithm.adv_estimator=gae", f"critic.model_path={path}"]


def _inputs(row: dict) -> PlanInputs:
    ns = argparse.Namespace(device="cuda", tuned=row.get("tuned", False), prompts=row.get("prompts", 32), n=8,
                            override=[*SETTINGS[row["settings"]], *_critic_dir(row), *row["overrides"]],
                            prompt_len=256, response_len=256)
    return plan_inputs(load_for_gpu([], bench_overrides(ns, row["preset"]), H200_GIB, row.get("gpus", 1)))


def predicted_gib(row: dict) -> float:
    inputs = _inputs(row)
    plan = plan_memory(inputs.engines, inputs.rollout, int(H200_GIB * GiB), inputs.stages)
    stage = plan.peak if row["stage"] == "peak" else plan.stage(row["stage"])
    return stage.total / GiB


def predicted_step_s(row: dict) -> float:
    inputs = _inputs(row)
    return predict_step_time(inputs.engines, inputs.rollout, inputs.stages, GPUS["h200"], inputs.samples_per_gpu).total


PEAKS = [r for r in ROWS if "measured_gib" in r]
STEPS = [r for r in ROWS if "measured_step_s" in r]


@pytest.mark.parametrize("row", PEAKS, ids=[r["name"] for r in PEAKS])
def test_predicted_peak_within_10_percent_of_measured(row):
    got = predicted_gib(row)
    assert abs(got / row["measured_gib"] - 1) <= 0.10, f"{row['name']}: predicted {got:.1f} GiB, measured " \
                                                       f"{row['measured_gib']} GiB ({row['source']})"


def test_step_time_seven_b_shape_is_the_preset():
    from hybridflow.models.presets import preset_config
    from hybridflow.planning.model_shape import ModelShape
    from hybridflow.planning.step_time import _seven_b

    assert _seven_b() == ModelShape.from_hf(preset_config("qwen2.5-7b").to_dict())


@pytest.mark.parametrize("row", STEPS, ids=[r["name"] for r in STEPS])
def test_predicted_step_within_15_percent_of_measured(row):
    got = predicted_step_s(row)
    assert abs(got / row["measured_step_s"] - 1) <= 0.15, f"{row['name']}: predicted {got:.2f} s, measured " \
                                                          f"{row['measured_step_s']} s ({row['source']})"
