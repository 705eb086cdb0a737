"""Split a nested state into flat tensors plus a JSON skeleton, and back; capture and restore every RNG a rank
uses (python, numpy global, torch CPU, CUDA; byte states as hex) as JSON — the reason loading never unpickles.

A state is dicts (str/int keys), lists and tuples whose leaves are tensors (DTensors too), numpy arrays or JSON
scalars. Tensors are stored by path key (`optimizer/state/0/exp_avg`) in safetensors or DCP; everything else,
including the container shapes and key types, goes to a JSON skeleton. Anything else raises `TypeError` at save
time, in the caller's thread.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)
SEP = "/"


def flatten_state(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Return (tensors by path, skeleton). Raises TypeError/ValueError naming the offending path."""
    tensors: dict[str, torch.Tensor] = {}

    def add(path: str, t: torch.Tensor) -> None:
        if path in tensors:
            raise ValueError(f"checkpoint state: two tensors map to the key {path!r}; rename one of the dict keys "
                             f"(keys containing {SEP!r} or equal str/int keys collide)")
        tensors[path] = t

    def enc(node: Any, path: str) -> dict[str, Any]:
        if isinstance(node, torch.Tensor):
            add(path, node.detach())
            return {"t": path}
        if isinstance(node, np.ndarray):
            if node.dtype == object:
                raise TypeError(f"checkpoint state at {path!r}: numpy object arrays cannot be saved without pickling; "
                                "convert to a list of str/int/float")
            add(path, torch.from_numpy(np.ascontiguousarray(node)))
            return {"n": path}
        if isinstance(node, Mapping):
            items = []
            for k, v in node.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise TypeError(f"checkpoint state at {path!r}: dict key {k!r} has type {type(k).__name__}; "
                                    "only str and int keys are saved")
                items.append([k, enc(v, f"{path}{SEP}{k}" if path else str(k))])
            return {"d": items}
        if isinstance(node, (list, tuple)):
            kind = "l" if isinstance(node, list) else "u"
            return {kind: [enc(v, f"{path}{SEP}{i}" if path else str(i)) for i, v in enumerate(node)]}
        if isinstance(node, np.generic):
            node = node.item()
        if node is None or isinstance(node, (bool, int, str)):
            return {"v": node}
        if isinstance(node, float):
            # JSON has no inf/nan; keep them exact as strings.
            return {"f": repr(node)} if not math.isfinite(node) else {"v": node}
        if isinstance(node, torch.dtype):
            return {"dtype": str(node).removeprefix("torch.")}
        raise TypeError(f"checkpoint state at {path!r} has type {type(node).__name__}; checkpoints hold only tensors, "
                        "numpy arrays, dicts, lists, tuples and str/int/float/bool/None (no pickling) — convert it, "
                        "e.g. to a dict of those")

    skeleton = enc(state, "")  # fills `tensors`
    return tensors, skeleton


def unflatten_state(skeleton: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> Any:
    """Inverse of `flatten_state`; numpy leaves come back as numpy arrays."""

    def dec(node: dict[str, Any]) -> Any:
        (kind, val), = node.items()
        decode = {"t": lambda: tensors[val], "n": lambda: tensors[val].numpy(), "v": lambda: val,
                  "d": lambda: {k: dec(v) for k, v in val}, "l": lambda: [dec(v) for v in val],
                  "u": lambda: tuple(dec(v) for v in val), "f": lambda: float(val), "dtype": lambda: _dtype(val)}
        if kind not in decode:
            raise ValueError(f"checkpoint skeleton has unknown node kind {kind!r} (written by a newer hybridflow?)")
        return decode[kind]()

    return dec(skeleton)


def _dtype(name: str) -> torch.dtype:
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"checkpoint skeleton names unknown dtype {name!r}")
    return getattr(torch, name)


def tensor_keys(node: dict[str, Any]) -> list[str]:
    """Paths of all tensor leaves of a skeleton, in order."""
    (kind, val), = node.items()
    if kind in ("t", "n"):
        return [val]
    children = [v for _k, v in val] if kind == "d" else val if kind in ("l", "u") else []
    return [key for child in children for key in tensor_keys(child)]


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
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda and n == len(cuda):
        torch.cuda.set_rng_state_all([_hex_to_bytes(s) for s in cuda])
    elif cuda:
        logger.warning("checkpoint holds %d CUDA RNG states but this process sees %d GPUs; CUDA RNG not restored "
                           "(resume is not bit-exact for sampling on GPU)", len(cuda), n)
