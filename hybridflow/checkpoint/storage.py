"""Write and read one checkpoint component: JSON skeleton + tensors in safetensors (plain) or DCP (DTensors).

Format choice: a component with any DTensor goes through torch.distributed.checkpoint (every rank writes its
shards; loading reshards into the caller's templates); a component of plain tensors is assumed replicated and is
written once by rank 0 as safetensors. Only tensors reach DCP, so its pickled byte items never appear, and DCP's
`.metadata` is read with an allow-list unpickler — loading never runs arbitrary pickled code.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta, TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from hybridflow.checkpoint.atomic import read_json, write_json
from hybridflow.checkpoint.flatten import unflatten_state

SKELETON = "skeleton.json"
SAFETENSORS = "tensors.safetensors"
DCP_DIR = "dcp"


def choose_format(tensors: Mapping[str, torch.Tensor]) -> str:
    return "dcp" if any(isinstance(t, DTensor) for t in tensors.values()) else "safetensors"


class CpuStager:
    """Copies tensors to CPU for an async save into buffers (pinned for CUDA) reused between saves — safe since the
    manager waits for the previous write first. DTensors keep mesh and placements, their local shard moves."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, t in tensors.items():
            local = t.to_local() if isinstance(t, DTensor) else t
            buf = self._buffers.get(f"{prefix}/{key}")
            if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                buf = torch.empty(local.shape, dtype=local.dtype, device="cpu",
                                  pin_memory=local.is_cuda and torch.cuda.is_available())
                self._buffers[f"{prefix}/{key}"] = buf
            buf.copy_(local.detach(), non_blocking=local.is_cuda)
            out[key] = DTensor.__new__(DTensor, buf, t._spec, requires_grad=False) if isinstance(t, DTensor) else buf
        if any(t.is_cuda for t in tensors.values()):
            torch.cuda.synchronize()
        return out

    def clear(self) -> None:
        self._buffers.clear()


def _dedup_for_safetensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors sharing storage (tied embeddings) and wants contiguous CPU tensors.
    seen: set[int] = set()
    out = {}
    for key, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
        seen.add(ptr)
        out[key] = t
    return out


_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
            ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path"),
            ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice")}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP `.metadata` allowing only DCP's metadata classes, torch dtypes/Size and a few builtins."""

    def find_class(self, module: str, name: str) -> Any:
        obj = super().find_class(module, name) if (module, name) in _ALLOWED or module in _DCP_MODULES else None
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if obj is None or (module in _DCP_MODULES and not isinstance(obj, type)):
            raise pickle.UnpicklingError(f"checkpoint metadata references {module}.{name}, which is not allowed; "
                                         "refusing to unpickle it (the file may be corrupted or malicious)")
        return obj


class SafeFileSystemReader(dcp.FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def write_component(comp_dir: Path, tensors: Mapping[str, torch.Tensor], skeleton: dict[str, Any], fmt: str,
                    rank: int, group: dist.ProcessGroup | None) -> None:
    """Write one component; every rank calls it (DCP is collective), rank 0 writes the replicated files."""
    comp_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        write_json(comp_dir / SKELETON, skeleton, fsync=False)
    assert fmt in ("safetensors", "dcp"), f"unknown component format {fmt!r}"
    if fmt == "safetensors" and rank == 0:
        save_file(_dedup_for_safetensors(tensors), str(comp_dir / SAFETENSORS))
    elif fmt == "dcp":
        dcp.save(dict(tensors), storage_writer=dcp.FileSystemWriter(str(comp_dir / DCP_DIR), sync_files=True),
                 process_group=group, no_dist=group is None and not dist.is_initialized())


def read_flat_tensors(comp_dir: Path, fmt: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """Full CPU tensors of a component whose path starts with `prefix` (e.g. "model/"), keys as stored; DCP shards
    of any world size are gathered in this one process (e.g. for export)."""
    if fmt == "safetensors":
        with safe_open(str(comp_dir / SAFETENSORS), framework="pt", device="cpu") as f:
            return {k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)}
    if fmt != "dcp":
        raise ValueError(f"{comp_dir}: unknown component format {fmt!r} (written by a newer hybridflow?)")
    template = {}
    for key, md in SafeFileSystemReader(str(comp_dir / DCP_DIR)).read_metadata().state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise ValueError(f"{comp_dir}: item {key!r} is not a tensor; hybridflow checkpoints hold only tensors")
        if key.startswith(prefix):
            template[key] = torch.empty(md.size, dtype=md.properties.dtype)
    if template:
        dcp.load(template, storage_reader=SafeFileSystemReader(str(comp_dir / DCP_DIR)), no_dist=True)
    return template


# What a damaged (truncated, overwritten) file raises while it is read: DCP wraps its ranks' errors in a
# CheckpointException (a BaseException), a cut pickle raises EOFError or UnpicklingError.
DAMAGED_FILE_ERRORS = (CheckpointException, SafetensorError, json.JSONDecodeError, UnicodeDecodeError,
                       pickle.UnpicklingError, EOFError, OSError)


class DamagedCheckpointError(ValueError):
    """A checkpoint file that cannot be read; the message names the file and the fix."""


def damaged_file(comp_dir: Path, fmt: str) -> str:
    """The first file of a component that does not read back (skeleton, safetensors header, DCP metadata), else the
    component's tensor files — the DCP shards, whose damage shows only when their bytes are read."""
    try:
        read_json(comp_dir / SKELETON)
    except (OSError, ValueError):
        return str(comp_dir / SKELETON)
    if fmt == "safetensors":
        return str(comp_dir / SAFETENSORS)
    try:
        SafeFileSystemReader(str(comp_dir / DCP_DIR)).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, ValueError):
        return str(comp_dir / DCP_DIR / ".metadata")
    shards = sorted(str(p) for p in (comp_dir / DCP_DIR).glob("*.distcp"))
    return ", ".join(shards) or str(comp_dir / DCP_DIR)


def read_component(comp_dir: Path, fmt: str, template: Mapping[str, torch.Tensor] | None,
                   group: dist.ProcessGroup | None) -> Any:
    """Read one component back into its nested form, into `template`'s tensors in place when given (DCP
    reshards), else as full CPU tensors; a damaged file is a DamagedCheckpointError naming it."""
    try:
        return _read_component(comp_dir, fmt, template, group)
    except DAMAGED_FILE_ERRORS as err:
        raise damaged(damaged_file(comp_dir, fmt), comp_dir.parent, err) from err


def damaged(file: str | Path, ckpt: Path, err: BaseException) -> DamagedCheckpointError:
    """The error for a checkpoint file that cannot be read: the file, the underlying error, the fix."""
    failures = getattr(err, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
    if failures:
        rank, wrapped = next(iter(failures.items()))
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        err_text = f"rank {rank}: {type(cause).__name__}: {cause}"
    else:
        err_text = f"{type(err).__name__}: {err}"
    err_text = err_text.strip().splitlines()[0] if err_text.strip() else type(err).__name__
    return DamagedCheckpointError(
        f"checkpoint file {file} cannot be read ({err_text}); the checkpoint {ckpt} is damaged. Fix: delete that "
        "directory so the run resumes from the previous complete checkpoint (or set trainer.resume_path to one), "
        "or set trainer.resume_mode=disable to start fresh")


def _read_component(comp_dir: Path, fmt: str, template: Mapping[str, torch.Tensor] | None,
                    group: dist.ProcessGroup | None) -> Any:
    skeleton = read_json(comp_dir / SKELETON)
    if template is not None and fmt == "dcp":
        loaded = dict(template)
        dcp.load(loaded, storage_reader=SafeFileSystemReader(str(comp_dir / DCP_DIR)), process_group=group,
                 no_dist=group is None and not dist.is_initialized())
    else:
        loaded = read_flat_tensors(comp_dir, fmt)
        if template is not None:
            # Tensors the template has are filled in place; ones it lacks (e.g. a fresh optimizer's state) come
            # back as new CPU tensors.
            present = {k: t for k, t in template.items() if k in loaded}
            _copy_into(present, loaded, comp_dir)
            loaded = {**loaded, **present}
    return unflatten_state(skeleton, loaded)


@torch.no_grad()
def _copy_into(template: Mapping[str, torch.Tensor], loaded: Mapping[str, torch.Tensor], where: Path) -> None:
    for key, dst in template.items():
        src = loaded[key]
        if dst.shape != src.shape:
            raise ValueError(f"{where}: tensor {key!r} has shape {tuple(src.shape)} in the checkpoint but "
                             f"{tuple(dst.shape)} in the model; was the model config changed since saving?")
        if isinstance(dst, DTensor):  # saved unsharded (one rank), loaded sharded: this rank's shard of the full one
            dst.to_local().copy_(distribute_tensor(src.to(dst.device), dst.device_mesh, dst.placements).to_local())
        else:
            dst.copy_(src)
