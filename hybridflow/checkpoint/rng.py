"""Capture and restore every RNG a training rank uses (python, numpy global, torch CPU, CUDA) as JSON.

Byte states are hex strings, so the per-rank `ranks/rank_<r>.json` file needs no pickling to load.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)


def _bytes_to_hex(t: torch.Tensor) -> str:
    return t.cpu().numpy().tobytes().hex()


def _hex_to_bytes(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray.fromhex(s), dtype=torch.uint8).clone()


def capture_rng_state() -> dict[str, Any]:
    """JSON-able snapshot of python `random`, numpy's global RNG, torch CPU and all CUDA generators."""
    py_version, py_state, py_gauss = random.getstate()
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": py_version, "state": list(py_state), "gauss": py_gauss},
        "numpy": {"kind": np_kind, "keys": np_keys.tolist(), "pos": int(np_pos), "has_gauss": int(np_has_gauss),
                  "gauss": float(np_gauss)},
        "torch": _bytes_to_hex(torch.get_rng_state()),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_bytes_to_hex(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng_state`. CUDA states are restored when the device count matches, else warned."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state((npst["kind"], np.asarray(npst["keys"], dtype=np.uint32), npst["pos"], npst["has_gauss"],
                         npst["gauss"]))
    torch.set_rng_state(_hex_to_bytes(state["torch"]))
    cuda = state.get("cuda") or []
    if cuda:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda):
            torch.cuda.set_rng_state_all([_hex_to_bytes(s) for s in cuda])
        else:
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            logger.warning("checkpoint holds %d CUDA RNG states but this process sees %d GPUs; CUDA RNG not restored "
                           "(resume is not bit-exact for sampling on GPU)", len(cuda), n)
