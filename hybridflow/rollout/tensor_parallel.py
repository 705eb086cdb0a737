"""Tensor-parallel generation: one rank's process group, its `TPLayout`, and the forward pieces that need collectives.

Built once per engine (`TPContext.for_module`), never per weight switch. Each rank runs the forward on its local
shapes (`tp_layout.local_spec`); `decode_ops` swaps in the pieces that differ from one device: the row-parallel
o_proj and down_proj outputs are all-reduced before their bias and the residual add, the embedding is
vocab-parallel (ids outside the shard give zero rows, then one all-reduce: an exact sum), and the LM head gives
local logits [b, V/tp] with the padded columns at -inf — never gathered (`sampling.ShardedSampler` draws across
the shards). With TP the swapped pieces run eagerly (the column-parallel q/k/v pieces keep the device's choice).
`reference_slices` cuts a whole HF module into this rank's slices: the single-process path and the reference for
the resharding of FSDP2 shards.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridflow.rollout.forward import DecodeOps, rms_norm, scaled
from hybridflow.rollout.tp_layout import TPLayout, check_divisible, local_spec, param_slice, take, vocab_range
from hybridflow.rollout.weights import ArchSpec, LayerWeights, ModelWeights, arch_spec, tp_model_weights

# torch >= 2.13 names it all_gather_single (all_gather_into_tensor: deprecated); the output stacks along dim 0
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TPContext:
    """This rank's tensor-parallel group: `layout` (size, rank), the whole model's `spec` and the rank's `local`
    one, its vocabulary shard [vocab_start, vocab_stop) of `local.vocab` rows (padded on the last rank)."""

    def __init__(self, group: dist.ProcessGroup | None, spec: ArchSpec, intermediate: int) -> None:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        check_divisible(spec, intermediate, size)
        self.group, self.spec = group, spec
        self.layout = TPLayout(size, rank)
        self.local = local_spec(spec, self.layout)
        self.vocab_start, self.vocab_stop, _ = vocab_range(spec.vocab, self.layout)
        self._real_cols = self.vocab_stop - self.vocab_start  # columns past it are padding
        # The group's first global rank: every rank of the group draws with the same default seeds.
        self.first_rank = dist.get_process_group_ranks(group or dist.group.WORLD)[0]

    @classmethod
    def for_module(cls, module: nn.Module, group: dist.ProcessGroup | None = None) -> TPContext:
        """The context of a Llama-family HF causal LM over `group` (None = the default group)."""
        return cls(group, arch_spec(module), module.config.intermediate_size)

    @property
    def size(self) -> int:
        return self.layout.size

    def model_weights(self, local: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> ModelWeights:
        """This rank's `ModelWeights` from its slices {HF parameter name: tensor} (`weights.tp_model_weights`)."""
        return tp_model_weights(local, self.spec, self.layout, dtype, device)

    # ------------------------------------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns `t`."""
        dist.all_reduce(t, group=self.group)
        return t

    def agree_min(self, value: int, device: torch.device) -> int:
        """The smallest `value` over the group: plans made from each rank's own free memory (KV slots) must agree,
        or the ranks would admit different rows and their collectives stop matching."""
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[size, *t.shape]: every rank's `t`, in rank order."""
        out = t.new_empty((self.size * t.shape[0], *t.shape[1:]))
        _all_gather_single(out, t.contiguous(), group=self.group)
        return out.view(self.size, *t.shape)

    # --------------------------------------------------------------------------------------- forward pieces
    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: this shard's rows for its ids, zeros for the others, summed over the group."""
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self._real_cols)
        x = F.embedding(local.clamp(0, table.shape[0] - 1), table)
        return self.all_reduce(x.masked_fill_(~mine[..., None], 0))

    def embed_norm(self, tok: torch.Tensor, table: torch.Tensor, ln1: torch.Tensor, eps: float,
                   scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = scaled(self.embed(tok, table), scale)
        return x, rms_norm(x, ln1, eps)

    def mlp_block(self, x: torch.Tensor, attn: torch.Tensor, lw: LayerWeights, eps: float) -> torch.Tensor:
        """`forward.mlp_block` on this rank's heads and intermediate rows: two all-reduces, biases after them."""
        h = self.all_reduce(F.linear(attn, lw.o))
        x = x + (h if lw.o_bias is None else h + lw.o_bias)
        xn = rms_norm(x, lw.ln2, eps)
        if lw.gate_up is not None:
            gate, up = F.linear(xn, lw.gate_up).chunk(2, dim=-1)
        else:
            gate, up = F.linear(xn, lw.gate), F.linear(xn, lw.up)
        return x + self.all_reduce(F.linear(F.silu(gate) * up, lw.down))

    def mlp_block_norm(self, x: torch.Tensor, attn: torch.Tensor, lw: LayerWeights, next_norm: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.mlp_block(x, attn, lw, eps)
        return x, rms_norm(x, next_norm, eps)

    def logits(self, x: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """This rank's logits [..., V/tp]; the padding columns are -inf (they can never be drawn)."""
        out = F.linear(x, lm_head)
        if self._real_cols < out.shape[-1]:
            out[..., self._real_cols:] = float("-inf")
        return out

    def decode_ops(self, ops: DecodeOps) -> DecodeOps:
        """`ops` with the pieces that talk to the group replaced (chosen once, like the ops themselves)."""
        return dataclasses.replace(ops, mlp_block=self.mlp_block, mlp_block_norm=self.mlp_block_norm,
                                   embed_norm=self.embed_norm, embed=self.embed, logits=self.logits)


def reference_slices(module: nn.Module, ctx: TPContext) -> dict[str, torch.Tensor]:
    """{parameter name: this rank's slice} of a whole (not FSDP-sharded, LoRA-free) HF module, by
    `tp_layout.param_slice` — the form the resharding produces; build weights with `weights.tp_model_weights`."""
    out = {}
    for name, p in module.named_parameters():
        if hasattr(p, "to_local") or "lora_" in name:
            raise ValueError(f"reference_slices reads whole parameters; {name} is sharded or a LoRA factor: "
                             "give tp_model_weights the resharded slices instead")
        name = name.replace("base_layer.", "")
        out[name] = take(p.detach(), param_slice(name, p.shape, ctx.spec, ctx.layout))
    return out
