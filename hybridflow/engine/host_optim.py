"""CPU-resident optimizer step (`fsdp.optimizer_offload=cpu_step`, ZeRO-Offload style): the device holds the
trained parameters in the compute dtype only; their fp32 master copies and Adam moments live in host memory, where
AdamW (torch's CPU kernels, multi-threaded) updates them.

Decisions: master copies are cut from the full-precision weights before FSDP2 wraps the module (the local Shard(0)
chunk, as FSDP2 cuts it), then the module is cast to the compute dtype, so FSDP2 never sees an fp32 parameter and the
device holds no master copy, no fp32 gradient and no optimizer state. A step moves the gradients in chunks through
two pinned staging buffers: the copy to the host of chunk k+1 and the copy back of chunk k-1 run on side streams
while the CPU updates chunk k. Clipping uses the engine's global norm (computed on the device, as without offload);
the skip of a non-finite step is read on the host. On the CPU (tests) the same code runs without streams and is
bitwise the plain AdamW step: same kernels (foreach), same clip, same order per element.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import _get_fqns
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from hybridflow.config.schema import OptimConfig
from hybridflow.engine.optim import build_optimizer
from hybridflow.utils.threads import usable_cores

CHUNK_NUMEL = 1 << 26  # elements per pipelined chunk (256 MB of fp32); a larger tensor is a chunk of its own


def cut_masters(model: nn.Module, master_dtype: torch.dtype, rank: int, world: int) -> dict[str, torch.Tensor]:
    """Host copies (in `master_dtype`) of this rank's Shard(0) chunk of every trained parameter, by name; call
    before `apply_fsdp2`, which cuts the same chunks (torch.chunk over the data-parallel ranks)."""
    masters = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                chunks = torch.chunk(p, world, dim=0) if p.dim() else (p,)
                local = chunks[rank] if rank < len(chunks) else p.new_empty((0, *p.shape[1:]))
                masters[name] = local.to(device="cpu", dtype=master_dtype, copy=True)
    return masters


def cast_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters (not buffers: RoPE's inverse frequencies stay fp32) to `dtype`, before FSDP2 wrapping."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


@dataclass
class _Slot:
    """A pinned staging buffer and the events that say when the device is done with it."""

    buf: torch.Tensor
    to_host: Any = None  # gradients copied in
    to_device: Any = None  # updated weights copied out


class _Lanes:
    """Where the copies run. On the CPU: in order, at once (no streams, nothing to wait for)."""

    def to_host(self, after: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def to_device(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def mark_to_host(self) -> Any:
        return None

    def mark_to_device(self) -> Any:
        return None

    def wait(self, event: Any) -> None:
        pass

    def after_main(self) -> None:
        pass

    def main_after_both(self) -> None:
        pass


class _CudaLanes(_Lanes):
    """Two side streams (device→host, host→device) beside the main stream; events mark each chunk's copies."""

    def __init__(self) -> None:
        self.d2h, self.h2d = torch.cuda.Stream(), torch.cuda.Stream()

    def to_host(self, after: Any = None) -> contextlib.AbstractContextManager:
        if after is not None:
            self.d2h.wait_event(after)
        return torch.cuda.stream(self.d2h)

    def to_device(self) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.h2d)

    def mark_to_host(self) -> Any:
        return self.d2h.record_event()

    def mark_to_device(self) -> Any:
        return self.h2d.record_event()

    def wait(self, event: Any) -> None:
        event.synchronize()

    def after_main(self) -> None:
        """Both side streams start after what the main stream has queued: the gradients and the norm (read),
        the last passes over the weights (overwritten)."""
        main = torch.cuda.current_stream()
        self.d2h.wait_stream(main)
        self.h2d.wait_stream(main)

    def main_after_both(self) -> None:
        main = torch.cuda.current_stream()
        main.wait_stream(self.h2d)
        main.wait_stream(self.d2h)


class HostOptimizer:
    """AdamW over host master copies of `params` (the module's trained, FSDP2-sharded, compute-dtype parameters).
    `optimizer` is the torch AdamW over the masters: the LR schedule, LR scaling and checkpoints use it."""

    def __init__(self, model: nn.Module, masters: dict[str, torch.Tensor], cfg: OptimConfig, fused: bool) -> None:
        if cfg.optimizer != "adamw":  # sft/rm/dpo sections reuse the actor's or critic's fsdp settings
            raise ValueError(f"optim.optimizer={cfg.optimizer!r} with fsdp.optimizer_offload=cpu_step: the host step "
                             "is torch's AdamW; set optimizer_offload to true or false, or optim.optimizer=adamw")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if sorted(n for n, _ in named) != sorted(masters):
            raise RuntimeError(f"trained parameters changed after the master copies were cut: {len(named)} now, "
                               f"{len(masters)} cut")
        self.params = [p for _, p in named]
        self.fqns = []
        for name, p in named:
            fqns = _get_fqns(model, name)
            assert len(fqns) == 1, f"{name}: one checkpoint name expected, got {fqns}"
            self.fqns.append(next(iter(fqns)))
            assert _local(p).shape == masters[name].shape, \
                f"{name}: local shard {tuple(_local(p).shape)} vs master copy {tuple(masters[name].shape)}"
        self.masters = [nn.Parameter(masters[n], requires_grad=True) for n, _ in named]
        self.optimizer = build_optimizer(self.masters, cfg, fused=fused)
        for m in self.masters:  # the state AdamW creates at its first step, made now: checkpoints need its tensors
            self.optimizer.state[m] = {"step": torch.zeros((), dtype=torch.float32),
                                       "exp_avg": torch.zeros_like(m), "exp_avg_sq": torch.zeros_like(m)}
        self.chunks = _chunks([m.numel() for m in self.masters], CHUNK_NUMEL)
        self.cuda = any(p.device.type == "cuda" for p in self.params)
        self._slots: list[_Slot] = []
        self._wide: torch.Tensor | None = None  # gradients widened to the master dtype, one chunk at a time
        self.fused = fused
        self._lanes_: _Lanes | None = None

    # ----------------------------------------------------------------------------------------- the step
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    @torch.no_grad()
    def step(self, grad_norm: torch.Tensor, max_norm: float, skip: bool) -> None:
        """Clip the device gradients by `grad_norm` (global), apply AdamW on the host, copy the new weights to the
        device; `skip` (non-finite loss or norm): drop the gradients, change nothing."""
        # parameters without a gradient (not reached by this loss) are left alone, as AdamW leaves them
        chunks = [c for c in ([i for i in c if self.params[i].grad is not None] for c in self.chunks) if c]
        if chunks and not skip:
            norm = grad_norm.detach().to("cpu")
            with _threads(host_cores() if self.cuda else torch.get_num_threads()):
                self._pipeline(chunks, norm, max_norm)
        self.zero_grad()

    def _pipeline(self, chunks: list[list[int]], norm: torch.Tensor, max_norm: float) -> None:
        """Chunk k+1's gradients go to the host and chunk k-1's weights to the device while the CPU updates chunk k,
        through two staging buffers that alternate."""
        lanes = self._lanes()
        lanes.after_main()
        slots = self._staging()
        self._grads_to_host(chunks[0], slots[0], lanes)
        for k, chunk in enumerate(chunks):
            slot = slots[k % 2]
            if k + 1 < len(chunks):
                self._grads_to_host(chunks[k + 1], slots[(k + 1) % 2], lanes)
            lanes.wait(slot.to_host)
            views = self._views(slot.buf, chunk)
            self._update(self._in_master_dtype(views, chunk), chunk, norm, max_norm)
            for v, i in zip(views, chunk):
                v.copy_(self.masters[i])  # rounded to the compute dtype in the staging buffer
            with lanes.to_device():
                for v, i in zip(views, chunk):
                    _local(self.params[i]).copy_(v, non_blocking=True)
                slot.to_device = lanes.mark_to_device()
        # the next forward reads the new weights; the gradients' memory is reused only after their copies
        lanes.main_after_both()

    def _grads_to_host(self, chunk: list[int], slot: _Slot, lanes: _Lanes) -> None:
        with lanes.to_host(after=slot.to_device):  # the copy out of this buffer's previous chunk is done first
            for v, i in zip(self._views(slot.buf, chunk), chunk):
                v.copy_(_local(self.params[i].grad), non_blocking=True)
            slot.to_host = lanes.mark_to_host()

    def _in_master_dtype(self, grads: list[torch.Tensor], chunk: list[int]) -> list[torch.Tensor]:
        """`grads` (compute dtype) widened into one reused buffer: a fresh tensor per chunk would cost more in page
        faults than the conversion itself. Already in the master dtype (CPU runs): themselves."""
        if grads[0].dtype == self.masters[chunk[0]].dtype:
            return grads
        if self._wide is None:
            self._wide = torch.empty(self._max_chunk(), dtype=self.masters[0].dtype)
        out = self._views(self._wide, chunk)
        for o, g in zip(out, grads):
            o.copy_(g)
        return out

    def _update(self, grads: list[torch.Tensor], chunk: list[int], norm: torch.Tensor, max_norm: float) -> None:
        masters = [self.masters[i] for i in chunk]
        for m, g in zip(masters, grads):
            m.grad = g
        if self.fused:  # the clip factor rides in the kernel (grad / grad_scale) instead of a pass of its own
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            self.optimizer.grad_scale = 1.0 / coef
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale
        else:  # foreach (CPU runs): the device step's clip, bit for bit
            torch.nn.utils.clip_grads_with_norm_(masters, max_norm, norm, foreach=True)
            self.optimizer.step()  # AdamW skips parameters without a gradient: only this chunk moves
        for m in masters:
            m.grad = None

    def _views(self, flat: torch.Tensor, chunk: list[int]) -> list[torch.Tensor]:
        out, offset = [], 0
        for i in chunk:
            n = self.masters[i].numel()
            out.append(flat[offset:offset + n].view(self.masters[i].shape))
            offset += n
        return out

    def _max_chunk(self) -> int:
        return max(sum(self.masters[i].numel() for i in c) for c in self.chunks)

    def _staging(self) -> list[_Slot]:
        if not self._slots:
            dtype = self.params[0].dtype
            self._slots = [_Slot(torch.empty(self._max_chunk(), dtype=dtype, pin_memory=self.cuda)) for _ in range(2)]
        return self._slots

    def _lanes(self) -> _Lanes:
        if self._lanes_ is None:
            self._lanes_ = _CudaLanes() if self.cuda else _Lanes()
        return self._lanes_

    @torch.no_grad()
    def push(self) -> None:
        """Masters → the device parameters (after a checkpoint load)."""
        for p, m in zip(self.params, self.masters):
            _local(p).copy_(m)

    # ----------------------------------------------------------------------------------------- checkpoints
    def model_entries(self) -> dict[str, DTensor | torch.Tensor]:
        """The masters as the checkpoint's model entries (full precision), sharded like the module's parameters:
        DCP saves them and loads into them in place."""
        return {fqn: _like(p, m.data) for fqn, p, m in zip(self.fqns, self.params, self.masters)}

    def optimizer_state(self) -> dict[str, Any]:
        """AdamW's state in the layout of torch's `get_state_dict` (keys = parameter names), so a checkpoint of
        this mode and one of the device step hold the same entries."""
        state = {}
        for fqn, p, m in zip(self.fqns, self.params, self.masters):
            s = self.optimizer.state[m]
            state[fqn] = {"step": s["step"], "exp_avg": _like(p, s["exp_avg"]), "exp_avg_sq": _like(p, s["exp_avg_sq"])}
        index = {id(m): fqn for fqn, m in zip(self.fqns, self.masters)}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(m)] for m in g["params"]]}
                  for g in self.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load(self, model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
        """Masters and AdamW state from checkpoint entries (copies; a no-op for the tensors DCP loaded in place),
        hyper-parameters of the saved groups (the LR), then the weights to the device."""
        for fqn, m in zip(self.fqns, self.masters):
            m.copy_(_to_local(model_state[fqn]))
            saved, s = optim_state["state"][fqn], self.optimizer.state[m]
            for key in ("step", "exp_avg", "exp_avg_sq"):
                s[key].copy_(_to_local(saved[key]))
        saved_groups = optim_state["param_groups"]
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise ValueError(f"checkpoint has {len(saved_groups)} optimizer parameter groups, this engine "
                             f"{len(self.optimizer.param_groups)}")
        for group, saved in zip(self.optimizer.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k not in ("params", "fused", "foreach")})
        self.push()


def host_cores() -> int:
    """Intra-op threads of the host step on a GPU run: this process's share of the cores it may use (the ranks on
    one host step at the same time: `LOCAL_WORLD_SIZE`). A GPU run otherwise keeps few (utils/threads.py); the step
    is the only host work while the device waits for it, and it is bound by memory bandwidth, which one thread
    does not fill."""
    return max(1, usable_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _to_local(t: Any) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else torch.as_tensor(t)


def _like(param: torch.Tensor, local: torch.Tensor) -> DTensor | torch.Tensor:
    """`local` (host memory) as a tensor sharded like `param`, sharing `local`'s storage. Not `DTensor.from_local`:
    that moves the local tensor to the mesh's device (the GPU); built as the checkpoint stager builds its CPU
    DTensors (checkpoint/storage.py), with `local`'s dtype."""
    if not isinstance(param, DTensor):
        return local
    meta = TensorMeta(param.shape, param.stride(), local.dtype)
    out = DTensor.__new__(DTensor, local, DTensorSpec(param.device_mesh, param.placements, tensor_meta=meta),
                          requires_grad=False)
    assert out._local_tensor is local, "the checkpoint entry must alias the host tensor (DCP loads in place)"
    return out


def _chunks(numels: list[int], budget: int) -> list[list[int]]:
    """Consecutive index groups of at most `budget` elements (a larger tensor alone)."""
    out: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(numels):
        if out[-1] and size + n > budget:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out if out[0] else []
