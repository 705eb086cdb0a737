"""FSDP2 shards → tensor-parallel slices at the hybrid-engine switch, moving only the bytes each rank needs.

Generation layout: the FSDP2 world of N ranks forms N / tp groups of `tp` consecutive ranks (rank k: TP rank k % tp,
group k // tp) — consecutive so that a group's per-layer all-reduces stay inside one node when N spans nodes.
FSDP2 shards every parameter on dim 0 in `torch.chunk` pieces over all N ranks; a rank needs `tp_layout.param_slice`
of it for its TP rank. Both are pure functions of shapes, so every rank computes the whole exchange itself (no
metadata messages) and moves exactly the intersections (held rows ∩ wanted rows / columns), cast to the generation
dtype, with one `all_to_all_single` per decoder layer (and one for the embeddings / norm / head) over the FSDP2 group.
Not all-gathers within TP groups: with DP > 1 a TP rank's slice lies in the shards of all N ranks (a row-parallel
slice crosses every shard), and with DP = 1 an all-gather would bring every rank the whole tensor, tp× what it needs.
LoRA: the factors' needed parts travel in the same exchange (B's rows of a column-parallel slice, A's columns of a
row-parallel one) and are merged on the slice, W_slice + s·B_slice·A_slice; the full merged matrix never exists.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Shard

from hybridflow.engine.lora import is_adapter_param, lora_factors
from hybridflow.rollout.tp_layout import Slice, TPLayout, check_divisible, param_slice
from hybridflow.rollout.weights import arch_spec

logger = logging.getLogger(__name__)

Box = tuple[int, int, int, int]  # rows [r0, r1) × columns [c0, c1) of a tensor seen as [rows, cols]
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def generation_layout(rank: int, tp: int) -> TPLayout:
    """Rank `rank` of the training world in generation: TP rank `rank % tp` of group `rank // tp`."""
    return TPLayout(tp, rank % tp)


def tp_group_ranks(world: int, tp: int) -> list[list[int]]:
    """The training ranks of each generation group (consecutive ranks), in group order."""
    if tp < 1 or world % tp:
        raise ValueError(f"rollout.tensor_model_parallel_size={tp} must divide the training world size {world}; "
                         f"choose a divisor of {world}")
    return [list(range(g * tp, (g + 1) * tp)) for g in range(world // tp)]


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of FSDP2's dim-0 shard on `rank`: `torch.chunk` pieces of ceil(rows / world) rows (the last
    ones short or empty)."""
    chunk = -(-rows // world)
    start = min(rows, rank * chunk)
    return start, min(rows, start + chunk)


def _box(sl: Slice | None, rows: int, cols: int) -> Box:
    if sl is None:
        return 0, rows, 0, cols
    if sl.dim == 0:
        return sl.start, sl.stop, 0, cols
    return 0, rows, sl.start, sl.stop


def _meet(a: Box, b: Box) -> Box | None:
    box = max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3])
    return box if box[0] < box[1] and box[2] < box[3] else None


def _numel(box: Box) -> int:
    return (box[1] - box[0]) * (box[3] - box[2])


@dataclass(frozen=True)
class _Part:
    """One tensor of an exchange: its full [rows, cols] view, the box each TP rank wants, this rank's output shape."""

    key: str  # output name, or `<weight name>|lora_A` / `|lora_B` for a LoRA factor
    rows: int
    cols: int
    wants: tuple[Box, ...]  # by TP rank
    out_shape: tuple[int, ...]  # this rank's slice, padded vocabulary rows included
    pad_rows: int  # trailing zero rows of this rank's slice (the last vocabulary shard)
    sharded: bool  # False: every rank holds it whole (no FSDP2, or one rank) — taken locally


@dataclass(frozen=True)
class _Plan:
    """One exchange seen from this rank: (part index, box) per peer to send and to receive, in part order."""

    sends: tuple[tuple[tuple[int, Box], ...], ...]
    recvs: tuple[tuple[tuple[int, Box], ...], ...]
    local: tuple[tuple[int, Box], ...]

    def sizes(self, side: tuple[tuple[tuple[int, Box], ...], ...]) -> list[int]:
        return [sum(_numel(box) for _, box in pieces) for pieces in side]


def _plan(parts: list[_Part], world: int, me: int, tp: int) -> _Plan:
    sends: list[list[tuple[int, Box]]] = [[] for _ in range(world)]
    recvs: list[list[tuple[int, Box]]] = [[] for _ in range(world)]
    local: list[tuple[int, Box]] = []
    for i, part in enumerate(parts):
        want = part.wants[me % tp]
        if not part.sharded:
            local.append((i, want))
            continue
        held = [(*shard_rows(part.rows, world, rank), 0, part.cols) for rank in range(world)]
        for peer in range(world):
            if peer == me:
                continue
            if box := _meet(held[me], part.wants[peer % tp]):
                sends[peer].append((i, box))
            if box := _meet(held[peer], want):
                recvs[peer].append((i, box))
        if box := _meet(held[me], want):
            local.append((i, box))
    return _Plan(tuple(map(tuple, sends)), tuple(map(tuple, recvs)), tuple(local))


@dataclass
class _Batch:
    """The tensors of one exchange (a decoder layer, or the rest) and its LoRA merges (weight name, scale)."""

    parts: list[_Part] = field(default_factory=list)
    params: list[torch.Tensor] = field(default_factory=list)
    merges: list[tuple[str, float]] = field(default_factory=list)

    def add(self, part: _Part, p: torch.Tensor) -> None:
        self.parts.append(part)
        self.params.append(p)


def _copy(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """All pieces in one `_foreach_copy_` (cast included): a few kernels per exchange, not one per piece."""
    if dst:
        torch._foreach_copy_(dst, src)


def _sharded(p: torch.Tensor) -> bool:
    return hasattr(p, "to_local") and p.device_mesh.size() > 1


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


class Resharder:
    """Builds {HF parameter name (PEFT's `base_layer.` stripped, LoRA merged): this rank's TP slice} from an FSDP2
    module at each switch. The exchange plans depend on shapes only and are computed once per set of tensors."""

    def __init__(self, module: nn.Module, tp: int, dtype: torch.dtype) -> None:
        self.module, self.tp, self.dtype = module, tp, dtype
        self.spec = arch_spec(module)
        check_divisible(self.spec, module.config.intermediate_size, tp)
        self._fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
        self._reshard_fsdp()
        sharded = [p for p in module.parameters() if _sharded(p)]
        mesh = sharded[0].device_mesh if sharded else None
        bad = [p.placements for p in sharded if p.device_mesh != mesh or p.placements != (Shard(0),)]
        if mesh is not None and (mesh.ndim != 1 or bad):
            raise ValueError(f"resharding to tensor-parallel slices needs FSDP2 over one 1-D mesh with Shard(0) "
                             f"parameters, got mesh {mesh} and placements {bad[:1]}; use the engine's FSDP2 "
                             f"wrapping (engine/fsdp.py)")
        self.group = mesh.get_group() if mesh is not None else None
        self.world = mesh.size() if mesh is not None else 1
        self.rank = dist.get_rank(self.group) if mesh is not None else 0
        tp_group_ranks(self.world, tp)  # validates tp | world
        self.layout = generation_layout(self.rank, tp)
        self._lora = {f"{name}.base_layer.weight": m for name, m in module.named_modules() if hasattr(m, "lora_A")}
        # the slices the engine holds, refilled in place at every switch: same storage → its CUDA graphs stay valid,
        # and no second copy of the slices exists while the new ones arrive
        self._outs: dict[str, torch.Tensor] = {}
        self._plans: dict[tuple[_Part, ...], _Plan] = {}

    def _reshard_fsdp(self) -> None:
        """Free unsharded leftovers of a forward: the parameters are then the DTensor shards this plan reads."""
        for m in self._fsdp:
            m.reshard()

    def _part(self, key: str, p: torch.Tensor, sl_of: dict[int, Slice | None]) -> _Part:
        rows, cols = p.shape[0], math.prod(p.shape[1:])  # shapes only: p[0] on a DTensor would all-gather it
        wants = tuple(_box(sl_of[r], rows, cols) for r in range(self.tp))
        sl, shape = sl_of[self.layout.rank], list(p.shape)
        pad = 0
        if sl is not None:
            shape[sl.dim] = max(sl.length, sl.pad_to)
            pad = shape[sl.dim] - sl.length
        return _Part(key, rows, cols, wants, tuple(shape), pad, _sharded(p))

    def _batches(self) -> tuple[list[_Batch], dict[str, str]]:
        """One exchange per decoder layer, then one for the rest; and tied names → the name they alias."""
        layers: dict[int, _Batch] = {}
        rest = _Batch()
        seen: dict[int, str] = {}
        aliases: dict[str, str] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if is_adapter_param(name):
                continue
            out = name.replace(".base_layer.", ".")
            if id(p) in seen:
                aliases[out] = seen[id(p)]
                continue
            seen[id(p)] = out
            slices = {r: param_slice(out, p.shape, self.spec, TPLayout(self.tp, r)) for r in range(self.tp)}
            m = _LAYER.search(name)
            batch = layers.setdefault(int(m.group(1)), _Batch()) if m else rest
            batch.add(self._part(out, p, slices), p)
            factors = lora_factors(self._lora[name]) if name in self._lora else None
            if factors is not None:  # B's rows of a column-parallel slice, A's columns of a row-parallel one
                b, a, scale = factors
                batch.add(self._part(f"{out}|lora_B", b, {r: s if s and s.dim == 0 else None
                                                          for r, s in slices.items()}), b)
                batch.add(self._part(f"{out}|lora_A", a, {r: Slice(1, s.start, s.stop) if s and s.dim == 1 else None
                                                          for r, s in slices.items()}), a)
                batch.merges.append((out, scale))
        return [layers[i] for i in sorted(layers)] + [rest], aliases

    def _plan_for(self, batch: _Batch) -> _Plan:
        key = tuple(batch.parts)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _plan(batch.parts, self.world, self.rank, self.tp)
        return plan

    @torch.no_grad()
    def reshard(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """({name: this rank's slice in the generation dtype}, metrics): bytes this rank received from / sent to other
        ranks and the peak extra memory of one exchange (send + receive buffers + LoRA factor slices)."""
        self._reshard_fsdp()
        batches, aliases = self._batches()
        out: dict[str, torch.Tensor] = {}
        bytes_in = bytes_out = peak = 0
        for batch in batches:
            got, sent, received = self._exchange(batch, self._plan_for(batch))
            extra = sent + received
            for w_key, scale in batch.merges:
                b, a = got.pop(f"{w_key}|lora_B"), got.pop(f"{w_key}|lora_A")
                extra += (a.numel() + b.numel()) * a.element_size()
                got[w_key].addmm_(b, a, alpha=scale)  # one rounding, as the one-rank merge (weights.py)
            out.update(got)
            bytes_in, bytes_out, peak = bytes_in + received, bytes_out + sent, max(peak, extra)
        for name, first in aliases.items():
            out[name] = out[first]
        metrics = {"rollout/reshard_bytes_in": float(bytes_in), "rollout/reshard_bytes_out": float(bytes_out),
                   "rollout/reshard_peak_mb": peak / 2**20}
        return out, metrics

    def _out(self, key: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        if "|lora_" in key:  # LoRA factor slices live only until their merge
            return torch.empty(shape, dtype=self.dtype, device=device)
        t = self._outs.get(key)
        if t is None or tuple(t.shape) != tuple(shape) or t.device != device:
            t = self._outs[key] = torch.empty(shape, dtype=self.dtype, device=device)
        return t

    def _exchange(self, batch: _Batch, plan: _Plan) -> tuple[dict[str, torch.Tensor], int, int]:
        """This rank's slices of one batch's tensors, by key; bytes sent and received."""
        sources = [_local(p) for p in batch.params]
        for part, src in zip(batch.parts, sources):
            rows = shard_rows(part.rows, self.world, self.rank) if part.sharded else (0, part.rows)
            assert src.shape[0] == rows[1] - rows[0], (part.key, tuple(src.shape), rows)
        device = sources[0].device
        outs = [self._out(part.key, part.out_shape, device) for part in batch.parts]
        for part, t in zip(batch.parts, outs):
            if part.pad_rows:
                t[t.shape[0] - part.pad_rows:].zero_()  # the padded vocabulary rows

        def src_view(i: int, box: Box) -> torch.Tensor:
            part, src = batch.parts[i], sources[i]
            h0 = shard_rows(part.rows, self.world, self.rank)[0] if part.sharded else 0
            return src.reshape(src.shape[0], part.cols)[box[0] - h0: box[1] - h0, box[2]: box[3]]

        def dst_view(i: int, box: Box) -> torch.Tensor:
            want = batch.parts[i].wants[self.layout.rank]
            flat = outs[i].view(outs[i].shape[0], -1)
            return flat[box[0] - want[0]: box[1] - want[0], box[2] - want[2]: box[3] - want[2]]

        _copy([dst_view(i, box) for i, box in plan.local], [src_view(i, box) for i, box in plan.local])
        send_sizes, recv_sizes = plan.sizes(plan.sends), plan.sizes(plan.recvs)
        if any(part.sharded for part in batch.parts):  # every rank agrees: shapes decide
            send = torch.empty(sum(send_sizes), dtype=self.dtype, device=device)
            self._pack(send, plan.sends, src_view, copy_out=True)
            recv = torch.empty(sum(recv_sizes), dtype=self.dtype, device=device)
            dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=self.group)
            self._pack(recv, plan.recvs, dst_view, copy_out=False)
        size = self.dtype.itemsize
        return ({part.key: t for part, t in zip(batch.parts, outs)}, sum(send_sizes) * size,
                sum(recv_sizes) * size)

    @staticmethod
    def _pack(flat: torch.Tensor, side: tuple[tuple[tuple[int, Box], ...], ...], view, copy_out: bool) -> None:
        """Copy each piece of `side` (peer-major, part order) between `flat` and its tensor `view(i, box)`."""
        chunks, views, offset = [], [], 0
        for pieces in side:
            for i, box in pieces:
                n = _numel(box)
                chunks.append(flat[offset: offset + n].view(box[1] - box[0], box[3] - box[2]))
                views.append(view(i, box))
                offset += n
        if copy_out:
            _copy(chunks, views)
        else:
            _copy(views, chunks)
