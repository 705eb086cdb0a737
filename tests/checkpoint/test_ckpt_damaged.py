"""A damaged checkpoint file fails with an error that names the file and the fix (not a bare EOFError or
`CheckpointException ranks:dict_keys([0])`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hybridflow.checkpoint import CheckpointManager
from hybridflow.checkpoint.storage import DamagedCheckpointError, read_component, write_component


def _cut(path: Path, keep: float = 0.4) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_truncated_safetensors_checkpoint_names_the_file(tmp_path) -> None:
    state = {"model": {"w": torch.randn(32, 32)}}
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        path = Path(mgr.save(1, {"actor": state}))
    victim = path / "actor" / "tensors.safetensors"
    _cut(victim)
    with pytest.raises(DamagedCheckpointError) as err:
        CheckpointManager(tmp_path, async_save=False).load()
    assert str(victim) in str(err.value) and "trainer.resume_mode=disable" in str(err.value)


@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata"])
def test_truncated_dcp_checkpoint_names_the_file(tmp_path, victim) -> None:
    comp = tmp_path / "global_step_1" / "actor"
    tensors = {"w": torch.randn(64, 64)}
    write_component(comp, tensors, {"w": {"__tensor__": "w"}}, "dcp", 0, None)
    _cut(comp / "dcp" / victim)
    for template in (None, {"w": torch.zeros(64, 64)}):
        with pytest.raises(DamagedCheckpointError) as err:
            read_component(comp, "dcp", template, None)
        assert str(comp / "dcp" / victim) in str(err.value) and "global_step_1" in str(err.value)
