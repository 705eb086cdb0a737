"""What a run ran on: library versions, device, host, git commit, and the resolved config, written at run start.

run_dir/config.yaml is the exact resolved config (re-runnable with `hybridflow train run_dir/config.yaml`);
run_dir/versions.json holds versions and device facts. Versions come from package metadata, so recording them
never imports heavy packages such as ray.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from hybridflow.config.loader import to_dict
from hybridflow.config.schema import Config
from hybridflow.utils.threads import usable_cores
from hybridflow.version import __version__

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
VERSIONS_FILE = "versions.json"
PACKAGES = ("torch", "transformers", "ray", "hybridflow", "tokenizers", "numpy", "tensordict", "wandb",
            "mlflow-skinny", "tensorboard", "swanlab")


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git_commit(path: Path) -> str | None:
    """HEAD of the git checkout containing `path` (source installs), else None."""
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def device_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda,
                            "cpu_count": usable_cores()}
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        props = [torch.cuda.get_device_properties(i) for i in range(n)]
        info.update(gpu_count=n, gpus=[p.name for p in props],
                    gpu_memory_gib=[round(p.total_memory / 2**30, 1) for p in props],
                    cudnn=torch.backends.cudnn.version(), nccl=_nccl_version())
    return info


def collect_versions() -> dict[str, Any]:
    """Versions of python and the relevant packages, the device, host and source commit."""
    versions = {name: package_version(name) for name in PACKAGES}
    versions["hybridflow"] = versions["hybridflow"] or __version__
    return {
        "python": platform.python_version(),
        "packages": versions,
        "device": device_info(),
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "git_commit": git_commit(Path(__file__).resolve().parents[1]),
        "argv": sys.argv,
        "start_time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def config_to_dict(config: Config | dict[str, Any] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return to_dict(config)
    if isinstance(config, dict):
        return dict(config)
    raise TypeError(f"config must be a hybridflow Config dataclass or a dict, got {type(config).__name__}")


def write_run_info(run_dir: str | Path, config: Config | dict[str, Any] | None = None) -> dict[str, Any]:
    """Write config.yaml and versions.json into `run_dir`, log a one-line summary, return the versions dict."""
    import yaml

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    info = collect_versions()
    (run_dir / VERSIONS_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    cfg = config_to_dict(config)
    if cfg:
        (run_dir / CONFIG_FILE).write_text(
            yaml.safe_dump(cfg, sort_keys=False, default_flow_style=False, width=110), encoding="utf-8")
    logger.debug("run info: %s → %s", summary(info), run_dir)  # the run_start event shows the summary
    return info


def summary(info: dict[str, Any]) -> str:
    """One line: python, key packages and the device."""
    pk = info["packages"]
    dev = info["device"]
    device = ", ".join(f"{n}x {g}" for g, n in _count(dev.get("gpus", [])).items()) or f"CPU ({dev['cpu_count']} cores)"
    parts = [f"python {info['python']}"] + [f"{n} {pk[n]}" for n in ("torch", "transformers", "ray", "hybridflow")
                                               if pk.get(n)]
    if dev.get("cuda"):
        parts.append(f"CUDA {dev['cuda']}")
    return ", ".join(parts) + f"; device: {device}"


def _count(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def _nccl_version() -> str | None:
    import torch

    try:
        v = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
