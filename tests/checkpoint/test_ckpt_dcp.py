"""Sharded (FSDP2 DTensor) checkpoints through DCP with 2 gloo ranks, async; reloaded in place and offline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridflow.checkpoint import CheckpointManager, atomic
from hybridflow.checkpoint.flatten import flatten_state
from hybridflow.checkpoint.storage import read_flat_tensors

WORKER = Path(__file__).with_name("dcp_worker.py")


@pytest.mark.parametrize("world", [2])
def test_fsdp2_sharded_save_reload(tmp_path: Path, world: int) -> None:
    proc = subprocess.run([sys.executable, str(WORKER), str(world), str(tmp_path), "1"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ckpt = tmp_path / "ckpt" / "global_step_1"
    assert atomic.is_complete(ckpt) and atomic.find_latest(tmp_path / "ckpt").name == "global_step_2"
    meta = atomic.read_json(ckpt / atomic.MARKER)
    assert meta["world_size"] == world and meta["components"]["actor"]["format"] == "dcp"
    assert sorted(p.name for p in (ckpt / "ranks").iterdir()) == [f"rank_{r:05d}.json" for r in range(world)]
    # offline, single process, no templates: full tensors equal the gathered reference
    ref = load_file(str(tmp_path / "ref.safetensors"))
    loaded = CheckpointManager(tmp_path / "ckpt", async_save=False).load(ckpt, restore_rng=False)
    flat, _ = flatten_state(loaded.components["actor"])
    assert sorted(flat) == sorted(ref)
    for k, v in ref.items():
        assert torch.equal(flat[k], v), k
    # the export path reads only the model tensors, unsharded, in one process
    model_only = read_flat_tensors(ckpt / "actor", "dcp", "model/")
    assert sorted(model_only) == sorted(k for k in ref if k.startswith("model/"))
    assert all(torch.equal(v, ref[k]) for k, v in model_only.items())
    # step 1 (above) was snapshotted before the in-place +100 update that ran while it was written; step 2 after it
    step2, _ = flatten_state(CheckpointManager(tmp_path / "ckpt").load(restore_rng=False).components["actor"])
    assert torch.equal(step2["model/0.weight"], ref["model/0.weight"] + 100.0)
    assert torch.equal(step2["optimizer/state/0.weight/exp_avg"], ref["optimizer/state/0.weight/exp_avg"])

