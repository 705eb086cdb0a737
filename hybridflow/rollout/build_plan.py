"""A recorded `WeightView.build`, replayed at later switches instead of walking the model again.

Walking the model (module attributes, PEFT wrappers, DTensor shards, buffer keys, merge grouping) costs ~5 ms of
Python per LoRA switch at 0.5B — more than the GPU work it launches. The walk's result depends only on which tensor
objects it read (parameters, their storage, shape and dtype) and on the LoRA layers' flags, so the first build records
what it ran as a list of ops over numbered sources, and later builds only re-read the sources, check they are what the
plan was made from, and run the ops again. Anything different (a parameter replaced, its storage moved — e.g. an
offload and back —, an adapter disabled or merged) → the caller builds (and records) the slow way again.

The ops are the only way either path touches the weights (the slow build executes each op as it records it), so a
replay launches exactly the kernels of a fresh build, with the same numerics.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import nn

from hybridflow.engine.lora import lora_state

COPY, ADDMM, STACKED, ADD_ONE = "copy", "addmm", "stacked", "add_one"
# COPY:    (COPY, destinations, source indices)                   one `_foreach_copy_` (cast included)
# ADDMM:   (ADDMM, w, b index, a index, scale)                    w += scale·B·A (one matrix)
# STACKED: (STACKED, sources, [(w [n, out, in], B stack shape [n, out, r], A stack shape [n, r, in], scale), ...])
#          fresh B and A stacks per chunk, filled from `sources` (each chunk's n B's then its n A's) by one
#          `_foreach_copy_` (cast included), then one `baddbmm_` per chunk (the stacks are temporaries, as in a fresh
#          build: allocated per run, at most STACK_BYTES at a time)
# ADD_ONE: (ADD_ONE, buffers)                                      fp32 buffers of w → 1 + w, w rounded to the
#          generation dtype first (Gemma's norm as the model computes it in that dtype: 1 + w.float())
Op = tuple


def run_ops(ops: list[Op], sources: list[torch.Tensor] | _Same, dtype: torch.dtype, device: torch.device) -> None:
    """Execute `ops`; `sources[i]` is the tensor behind source entry i (`SAME`: the entries are the tensors)."""
    for op in ops:
        kind = op[0]
        if kind == COPY:
            torch._foreach_copy_(op[1], [sources[i] for i in op[2]])
        elif kind == ADDMM:
            _, w, b, a, scale = op
            w.addmm_(sources[b].to(dtype), sources[a].to(dtype), alpha=scale)
        elif kind == ADD_ONE:
            if dtype != torch.float32:
                torch._foreach_copy_(op[1], [t.to(dtype) for t in op[1]])
            torch._foreach_add_(op[1], 1.0)
        else:
            dst: list[torch.Tensor] = []
            todo = []
            for w, b_shape, a_shape, scale in op[2]:
                b_stack = torch.empty(b_shape, dtype=dtype, device=device)
                a_stack = torch.empty(a_shape, dtype=dtype, device=device)
                dst += b_stack.unbind(0)
                dst += a_stack.unbind(0)
                todo.append((w, b_stack, a_stack, scale))
            torch._foreach_copy_(dst, [sources[i] for i in op[1]])
            for w, b_stack, a_stack, scale in todo:
                w.baddbmm_(b_stack, a_stack, alpha=scale)
            del dst, todo  # the stacks: temporaries, freed before the next group's


_LOCAL_TENSOR = operator.attrgetter("_local_tensor")


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor a replay reads for parameter `p`: a one-rank DTensor's shard, else the parameter itself."""
    local = getattr(p, "_local_tensor", None)
    return p if local is None else local


class _Same:
    """Sources of ops that hold the tensors themselves (the slow build's ops, before numbering)."""

    def __getitem__(self, t: torch.Tensor) -> torch.Tensor:
        return t


SAME = _Same()


class Recorder:
    """Collects one slow build: every source tensor it read (numbered in reading order), where the parameter behind
    it is registered (`module._parameters[name]`), and the ops it ran (numbered). A source that a replay cannot
    re-read the same way — a gathered or unsharded tensor (N ranks), a parameter not registered on any module —
    makes the build not replayable; from then on nothing is kept (no gathered tensor outlives its copy)."""

    def __init__(self, module: nn.Module) -> None:
        self.slot_of = {id(p): (m._parameters, name) for m in module.modules() for name, p in m._parameters.items()
                        if p is not None}
        self.sources: list[torch.Tensor] = []
        self.index: dict[int, int] = {}  # id(source tensor) -> its number (the tensors stay alive in `sources`)
        self.slots: list[tuple[dict, str]] = []
        self.params: list[torch.Tensor] = []
        self.ops: list[Op] = []
        self.replayable = True

    def add(self, p: torch.Tensor, src: torch.Tensor, temporary: bool, slot: tuple[dict, str] | None = None) -> None:
        """The slow build uses `src` for parameter `p` (registered at `slot`; default: where the model has it — one
        of its places if it is shared)."""
        if not self.replayable:
            return
        slot = slot or self.slot_of.get(id(p))
        if temporary or slot is None or (hasattr(p, "to_local") and getattr(p, "_local_tensor", None) is None):
            self.replayable = False
            self.sources, self.index, self.slots, self.params, self.ops = [], {}, [], [], []
            return
        self.index[id(src)] = len(self.sources)
        self.sources.append(src)
        self.slots.append(slot)
        self.params.append(p)

    def depend(self, owner: nn.Module, name: str) -> None:
        """`owner.<name>` (a registered parameter) must stay what it is now for the result to hold (tied embeddings
        and lm_head: both places, so that replacing either unties them and makes the plan stale)."""
        p = owner._parameters.get(name)
        if p is not None:
            self.add(p, _local(p).detach(), False, (owner._parameters, name))

    def run(self, op: Op, dtype: torch.dtype, device: torch.device) -> None:
        """Execute `op` (whose sources are tensors) now, and keep it with its sources numbered for replays."""
        run_ops([op], SAME, dtype, device)
        if not self.replayable:
            return
        num = self.index.__getitem__
        if op[0] == COPY:
            op = (COPY, op[1], [num(id(t)) for t in op[2]])
        elif op[0] == ADDMM:
            op = (ADDMM, op[1], num(id(op[2])), num(id(op[3])), op[4])
        elif op[0] == STACKED:
            op = (STACKED, [num(id(t)) for t in op[1]], op[2])
        self.ops.append(op)

    def plan(self, weights: object, lora_layers: list[nn.Module]) -> BuildPlan | None:
        """The replayable plan of the build just recorded (None when it is not replayable)."""
        if not self.replayable:
            return None
        return BuildPlan(slots=self.slots, params=self.params, lora_layers=lora_layers, ops=self.ops,
                         weights=weights)


_SHAPE_DTYPE = operator.attrgetter("shape", "dtype")


@dataclass
class BuildPlan:
    """A replayable build: valid while every recorded slot still holds the same parameter object, whose local
    tensor has the recorded data_ptr, shape and dtype, and every LoRA layer's `lora_state` is unchanged. Checked in
    a few C-level `map`s (~0.2 ms for the ~630 sources of a 24-layer LoRA model on a CPU core)."""

    slots: list[tuple[dict, str]]
    params: list[torch.Tensor]
    lora_layers: list[nn.Module]
    ops: list[Op]
    weights: object  # the ModelWeights of the recorded build (persistent buffers and the parameters themselves)
    dicts: list[dict] = field(init=False)
    names: list[str] = field(init=False)
    dtensor: list[bool] | bool = field(init=False)  # True / False: all / none are DTensors (their local shard)
    ptrs: list[int] = field(init=False)
    shapes: list[tuple] = field(init=False)
    lora_states: list[tuple] = field(init=False)

    def __post_init__(self) -> None:
        self.dicts = [d for d, _ in self.slots]
        self.names = [name for _, name in self.slots]
        flags = [getattr(p, "_local_tensor", None) is not None for p in self.params]
        self.dtensor = flags[0] if flags and all(f == flags[0] for f in flags) else flags
        tensors = self._locals(self.params)
        self.ptrs = list(map(torch.Tensor.data_ptr, tensors))
        self.shapes = list(map(_SHAPE_DTYPE, tensors))
        self.lora_states = [lora_state(m) for m in self.lora_layers]

    def _locals(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.dtensor is True:
            return list(map(_LOCAL_TENSOR, params))
        if self.dtensor is False:
            return params
        return [p._local_tensor if dt else p for p, dt in zip(params, self.dtensor)]

    def sources(self) -> list[torch.Tensor] | None:
        """The current source tensors, or None when the plan is stale."""
        params = list(map(dict.get, self.dicts, self.names))
        if not all(map(operator.is_, params, self.params)):
            return None
        tensors = self._locals(params)
        if list(map(torch.Tensor.data_ptr, tensors)) != self.ptrs or list(map(_SHAPE_DTYPE, tensors)) != self.shapes:
            return None
        if [lora_state(m) for m in self.lora_layers] != self.lora_states:
            return None
        return tensors

    def replay(self, dtype: torch.dtype, device: torch.device) -> object | None:
        """Run the recorded ops on the current sources and return the recorded weights; None (nothing run) when
        stale."""
        sources = self.sources()
        if sources is None:
            return None
        with torch.no_grad():  # the sources are the parameters themselves, not detached aliases
            run_ops(self.ops, sources, dtype, device)
        return self.weights
