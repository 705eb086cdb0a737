"""Save/load a DataProto without pickle: tensors in `tensors.safetensors`, everything else in `data.json`.

Non-tensor values and meta_info must be JSON values (str, int, float, bool, None, list, dict with str keys;
numpy scalars are converted), so loading a file can never execute code. Tuples are refused rather than silently
turned into lists.
"""

from __future__ import annotations

import json
import logging
from os import PathLike
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

FORMAT = "hybridflow.DataProto"
VERSION = 1
TENSORS_FILE = "tensors.safetensors"
DATA_FILE = "data.json"


def to_json(value: Any, where: str) -> Any:
    """`value` as plain JSON types; a ValueError naming `where` (the key path) for anything else."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                raise ValueError(f"{where} has the non-string dict key {k!r}; DataProto.save stores only JSON "
                                 "objects, whose keys are strings")
        return {k: to_json(v, f"{where}[{k!r}]") for k, v in value.items()}
    fix = "use a list" if isinstance(value, tuple) else "convert it (e.g. tensor.tolist()) or pop the key"
    raise ValueError(f"{where} holds a {type(value).__name__}, which DataProto.save cannot store: only JSON "
                     f"values (str, int, float, bool, None, list, dict) are saved, never pickle; {fix} first")


def _array_to_json(key: str, arr: np.ndarray) -> dict[str, Any]:
    where = f"non_tensor_batch[{key!r}]"
    if arr.dtype == object:
        values = [to_json(v, f"{where}[{i}]") for i, v in enumerate(arr.reshape(-1))]
    else:
        values = to_json(arr.reshape(-1).tolist(), where)
    return {"dtype": arr.dtype.str, "shape": list(arr.shape), "values": values}


def _array_from_json(entry: dict[str, Any]) -> np.ndarray:
    dtype, shape, values = np.dtype(entry["dtype"]), tuple(entry["shape"]), entry["values"]
    if not dtype.hasobject:
        return np.array(values, dtype=dtype).reshape(shape)
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):  # element-wise so list values stay list objects
        out[i] = v
    return out.reshape(shape)


def _tensors_for_disk(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors; a tensor sharing storage with an earlier key is cloned (safetensors refuses it)."""
    out, seen = {}, set()
    for key, value in batch.items():
        t = value.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def save(path: str | PathLike[str], batch: dict[str, torch.Tensor], non_tensor_batch: dict[str, np.ndarray],
         meta_info: dict[str, Any], num_rows: int) -> None:
    """Write the directory `path` (created if needed). Validates everything before writing any file."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "num_rows": num_rows,
        "batch_keys": list(batch),
        "non_tensor_batch": {k: _array_to_json(k, v) for k, v in non_tensor_batch.items()},
        "meta_info": {k: to_json(v, f"meta_info[{k!r}]") for k, v in meta_info.items()},
    }
    text = json.dumps(doc, ensure_ascii=False)
    tensors = _tensors_for_disk(batch)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(root / TENSORS_FILE), metadata={"format": FORMAT, "version": str(VERSION)})
    (root / DATA_FILE).write_text(text, encoding="utf-8")
    logger.debug("saved DataProto with %d rows to %s", num_rows, root)


def load(path: str | PathLike[str], device: str | torch.device = "cpu"
         ) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray], dict[str, Any]]:
    """Read a directory written by `save`: (batch, non_tensor_batch, meta_info)."""
    root = Path(path)
    data_file, tensors_file = root / DATA_FILE, root / TENSORS_FILE
    if not data_file.is_file() or not tensors_file.is_file():
        raise FileNotFoundError(f"{root} is not a saved DataProto: expected {DATA_FILE} and {TENSORS_FILE} in it")
    doc = json.loads(data_file.read_text(encoding="utf-8"))
    if doc.get("format") != FORMAT or doc.get("version") != VERSION:
        raise ValueError(f"{data_file}: format {doc.get('format')!r} version {doc.get('version')!r} is not "
                         f"{FORMAT!r} version {VERSION}")
    tensors = load_file(str(tensors_file), device=str(device))
    if set(tensors) != set(doc["batch_keys"]):
        raise ValueError(f"{root}: {TENSORS_FILE} holds {sorted(tensors)} but {DATA_FILE} lists "
                         f"{sorted(doc['batch_keys'])}")
    batch = {k: tensors[k] for k in doc["batch_keys"]}
    non_tensor_batch = {k: _array_from_json(v) for k, v in doc["non_tensor_batch"].items()}
    return batch, non_tensor_batch, doc["meta_info"]


def to_state(batch: dict[str, torch.Tensor], non_tensor_batch: dict[str, np.ndarray], meta_info: dict[str, Any],
             num_rows: int) -> dict[str, Any]:
    """The columns as a checkpoint state (`checkpoint/flatten.py`): the tensors (on CPU) and one JSON string for
    the non-tensor columns and meta_info. Raises ValueError as `save` does for a value JSON cannot hold."""
    doc = {"num_rows": num_rows,
           "non_tensor_batch": {k: _array_to_json(k, v) for k, v in non_tensor_batch.items()},
           "meta_info": {k: to_json(v, f"meta_info[{k!r}]") for k, v in meta_info.items()}}
    return {"tensors": {k: v.detach().cpu().contiguous() for k, v in batch.items()},
            "columns": json.dumps(doc, ensure_ascii=False)}


def from_state(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray], dict[str, Any]]:
    """Inverse of `to_state`: (batch, non_tensor_batch, meta_info)."""
    doc = json.loads(state["columns"])
    non_tensor_batch = {k: _array_from_json(v) for k, v in doc["non_tensor_batch"].items()}
    return dict(state["tensors"]), non_tensor_batch, doc["meta_info"]
