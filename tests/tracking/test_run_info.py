"""Run info: versions.json has what a bug report needs; config.yaml reloads to the same config."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

from hybridflow.config import load_config, to_dict
from hybridflow.tracking.run_info import summary, write_run_info


def test_versions_and_config_written(tmp_path: Path) -> None:
    cfg = load_config([], ["trainer.experiment_name=abc", "actor.optim.lr=3e-6"], validate=False)
    info = write_run_info(tmp_path, cfg)
    on_disk = json.loads((tmp_path / "versions.json").read_text())
    assert on_disk == info
    assert info["python"] == platform.python_version()
    assert info["packages"]["torch"] == torch.__version__.split("+")[0] or info["packages"]["torch"] == torch.__version__
    for name in ("transformers", "ray", "hybridflow"):
        assert name in info["packages"]
    assert info["device"]["cuda_available"] == torch.cuda.is_available()
    assert info["device"]["cuda"] == torch.version.cuda
    reloaded = load_config([tmp_path / "config.yaml"], [], validate=False)
    assert to_dict(reloaded) == to_dict(cfg)
    line = summary(info)
    assert f"torch {info['packages']['torch']}" in line and "device:" in line
