"""`hybridflow plan`: JSON output, the choice that fits, and the error naming what to change when nothing fits."""

import json
import re

from hybridflow.cli import main

SEVEN_B = ["model.preset=qwen2.5-7b", "data.max_prompt_length=256", "data.max_response_length=256", "rollout.n=8",
           "actor.ppo_mini_batch_size=32", "rollout.ignore_eos=true"]


def _plan(capsys, *args: str) -> tuple[int, dict]:
    rc = main(["plan", *args, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_7b_full_on_one_h200_chooses_cpu_step(capsys):
    # measured (docs/benchmarks.md): optimizer_offload=true runs out of memory on one H200, cpu_step fits
    rc, d = _plan(capsys, *SEVEN_B, "model.enable_gradient_checkpointing=true", "actor.fsdp.optimizer_offload=true")
    assert rc == 0 and d["prediction"] is True
    assert not d["fits"] and d["needed_gib"] > 139.7
    assert "actor.fsdp.optimizer_offload=cpu_step" in d["choice"]["overrides"]
    assert d["choice"]["needed_gib"] <= 139.7 and d["choice"]["host_gib_per_rank"] > 80  # fp32 masters + moments
    assert set(d["stages"]) == {"generate", "update_actor"}
    assert d["step_seconds"]["update_actor"] > d["step_seconds"]["generate"] > 0


def test_nothing_fits_names_the_fix(capsys):
    rc, d = _plan(capsys, *SEVEN_B, "--gpu-memory", "24")
    assert rc == 1 and "choice" not in d
    assert "does not fit 24 GiB" in d["error"] and "cpu_step" in d["error"]
    assert "model.lora.rank" in d["error"]
    assert re.search(r"--gpus (\d+) fits", d["error"]) and int(re.search(r"--gpus (\d+)", d["error"])[1]) > 1


def test_more_gpus_shard_the_state(capsys):
    _, one = _plan(capsys, *SEVEN_B, "--gpus", "1")
    _, four = _plan(capsys, *SEVEN_B, "--gpus", "4")
    params = [d["stages"]["update_actor"]["components_gib"]["actor/params"] for d in (one, four)]
    assert abs(params[0] / params[1] - 4) < 0.01


def test_fp8_rollout_names_its_weight_copies(capsys):
    small = ["model.preset=qwen2.5-0.5b", "data.max_prompt_length=128", "data.max_response_length=128",
             "rollout.quantization=fp8"]
    _, d = _plan(capsys, *small)
    assert d["stages"]["generate"]["components_gib"]["rollout/fp8_weights"] > 0.3  # 0.33 GiB at 0.5B
    assert d["notes"] and d["notes"][0].startswith("rollout/fp8_weights: the e4m3 copies")
    main(["plan", *small])
    out = " ".join(capsys.readouterr().out.split())  # the table's note, however the console wraps it
    assert "rollout/fp8_weights: the e4m3 copies of the decoder projections" in out
