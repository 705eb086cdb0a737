"""Mixture-of-Experts MLPs (Qwen3-MoE, Qwen2-MoE, Mixtral) for the rollout engine: router, grouped experts, record.

Routing follows transformers op for op: softmax in fp32 over the router logits, top-k, then (Qwen3/Qwen2 with
`norm_topk_prob`, always for Mixtral — equal to Mixtral's "top-k then softmax") renormalised over the k chosen;
Qwen casts the scores back to the activation dtype, Mixtral keeps them in fp32 until the weighted expert output is
cast. Experts run grouped (tokens sorted by expert, one SwiGLU per hit expert over its tokens, added back in
expert order, as HF does) — data-dependent shapes, so a host sync; under CUDA-graph capture, and for a few tokens
(`DENSE_MAX_PAIRS`), the dense form runs (every expert over every token, combined with a sparse [tokens, experts]
weight matrix: static shapes, E/k times the FLOPs).
`recording` collects each call's chosen experts: the model runner keeps them per KV slot and column
(`route_buffer`, int16: slots × max length × MoE layers × k — 0.8 GB at 256 × 4096 × 48 × 8) for routing replay.

Legend: N tokens, H hidden, E experts, k experts per token, I expert intermediate size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")
# Up to this many token × expert pairs the dense form beats the grouped one on a CPU core (measured: 8 experts,
# k=2: 64 tokens 0.6 vs 1.2 ms, 640 tokens 4.6 vs 2.4 ms; 64 experts, k=8: 8 tokens equal, 256 tokens 179 vs 29 ms)
DENSE_MAX_PAIRS = 512


@dataclass
class MoEWeights:
    router: torch.Tensor  # [E, H]
    gate_up: torch.Tensor  # [E, 2I, H]: [gate; up] rows of each expert
    down: torch.Tensor  # [E, H, I]
    top_k: int
    norm_topk: bool  # renormalise the k chosen probabilities to sum to 1
    fp32_scores: bool  # Mixtral: scores stay fp32; Qwen: cast to the activation dtype before weighting
    shared_gate: torch.Tensor | None = None  # Qwen2-MoE shared expert: SwiGLU gate/up/down and its sigmoid gate
    shared_up: torch.Tensor | None = None
    shared_down: torch.Tensor | None = None
    shared_expert_gate: torch.Tensor | None = None  # [1, H]
    sink: list[torch.Tensor] | None = None  # set by `recording`: each call appends its [N, k] expert ids

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.router, self.gate_up, self.down, self.shared_gate, self.shared_up,
                            self.shared_down, self.shared_expert_gate) if t is not None]


def is_moe_layer(mlp: nn.Module) -> bool:
    return hasattr(mlp, "experts") and hasattr(mlp, "gate")


def unsupported_reason(module: nn.Module) -> str | None:
    """Why the engine cannot run this MoE module natively (None = it can)."""
    for layer in module.model.layers:
        mlp = layer.mlp
        if not is_moe_layer(mlp):
            continue
        experts = mlp.experts
        if getattr(experts, "gate_up_proj", None) is None or getattr(experts, "down_proj", None) is None:
            return f"{type(experts).__name__} does not hold [experts, 2I, H] gate_up_proj / down_proj tensors"
        if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
            return "expert projections have biases"
        if getattr(experts, "is_transposed", False):
            return "expert weights are stored transposed"
    return None


def check_parallel(module: nn.Module, rollout_cfg: object) -> None:
    """MoE layers are not split across tensor-parallel ranks yet."""
    tp = getattr(rollout_cfg, "tensor_model_parallel_size", 1)
    if tp > 1 and getattr(module.config, "model_type", None) in MOE_MODEL_TYPES:
        raise ValueError(f"rollout.tensor_model_parallel_size={tp} with a Mixture-of-Experts model "
                         f"({module.config.model_type}): MoE layers run on one device only; set "
                         "rollout.tensor_model_parallel_size=1")


def build_weights(get: Callable[[nn.Module, str, str], torch.Tensor | None], mlp: nn.Module, cfg: object, lora_names: list[str]) -> MoEWeights:
    """The layer's MoE views through `get(owner, attr, role)` (WeightView._get: zero copy, cast or gathered)."""
    if lora_names:
        raise ValueError(f"LoRA adapts MoE router/expert weights ({lora_names[0]}, ...): the rollout engine merges "
                         "LoRA only into Linear layers; remove the router and experts from "
                         "model.lora.target_modules")
    mtype = cfg.model_type
    shared = getattr(mlp, "shared_expert", None)
    sgate = getattr(mlp, "shared_expert_gate", None)
    return MoEWeights(
        router=get(mlp.gate, "weight", "router"), gate_up=get(mlp.experts, "gate_up_proj", "experts_gate_up"),
        down=get(mlp.experts, "down_proj", "experts_down"), top_k=int(cfg.num_experts_per_tok),
        norm_topk=mtype == "mixtral" or bool(getattr(cfg, "norm_topk_prob", False)),
        fp32_scores=mtype == "mixtral",
        shared_gate=None if shared is None else get(shared.gate_proj, "weight", "shared_gate"),
        shared_up=None if shared is None else get(shared.up_proj, "weight", "shared_up"),
        shared_down=None if shared is None else get(shared.down_proj, "weight", "shared_down"),
        shared_expert_gate=None if sgate is None else get(sgate, "weight", "shared_expert_gate"))


def route(logits_NE: torch.Tensor, top_k: int, norm_topk: bool, fp32_scores: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [N, k], scores [N, k]) as transformers' routers compute them."""
    probs = torch.softmax(logits_NE, dim=-1, dtype=torch.float32)
    scores, idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return idx, scores if fp32_scores else scores.to(logits_NE.dtype)


def experts_grouped(x_NH: torch.Tensor, idx_Nk: torch.Tensor, scores_Nk: torch.Tensor, gate_up: torch.Tensor,
                    down: torch.Tensor) -> torch.Tensor:
    """Sum over each token's k experts of score · SwiGLU_e(x): assignments sorted by expert, one pair of matmuls
    per hit expert over its tokens, added back in expert order (HF's order: the same fp32 bits on CPU)."""
    N, k = idx_Nk.shape
    if N == 0:
        return torch.zeros_like(x_NH)
    flat = idx_Nk.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()  # host sync: per-expert sizes
    tok = order // k
    outs = []
    for e, xe in enumerate(x_NH.index_select(0, tok).split(counts)):
        if xe.shape[0]:
            gate, up = F.linear(xe, gate_up[e]).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, down[e]))
    y = torch.cat(outs) * scores_Nk.flatten().index_select(0, order)[:, None]
    return torch.zeros_like(x_NH).index_add_(0, tok, y.to(x_NH.dtype))


def experts_dense(x_NH: torch.Tensor, idx_Nk: torch.Tensor, scores_Nk: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor) -> torch.Tensor:
    """`experts_grouped` with static shapes: every expert over every token (E/k times the FLOPs), combined by a
    [N, E] matrix holding each token's scores at its chosen experts (zero elsewhere)."""
    combine_EN = torch.zeros(x_NH.shape[0], gate_up.shape[0], dtype=scores_Nk.dtype, device=x_NH.device)
    combine_EN = combine_EN.scatter_(1, idx_Nk, scores_Nk).T
    gate, up = torch.matmul(x_NH, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, N, I] each
    y_ENH = torch.bmm(F.silu(gate) * up, down.transpose(1, 2))
    return (y_ENH * combine_EN[..., None]).to(x_NH.dtype).sum(0)


@torch.compiler.disable  # data-dependent grouping; the dense attention/norm pieces around it stay compiled
def moe_mlp(xn: torch.Tensor, moe: MoEWeights) -> torch.Tensor:
    """The MoE MLP of a post-attention-normed xn [..., H]."""
    x_NH = xn.reshape(-1, xn.shape[-1])
    idx, scores = route(F.linear(x_NH, moe.router), moe.top_k, moe.norm_topk, moe.fp32_scores)
    if moe.sink is not None:
        moe.sink.append(idx)
    capturing = x_NH.is_cuda and torch.cuda.is_current_stream_capturing()
    small = x_NH.shape[0] * moe.gate_up.shape[0] <= DENSE_MAX_PAIRS
    experts = experts_dense if capturing or small else experts_grouped
    out = experts(x_NH, idx, scores, moe.gate_up, moe.down)
    if moe.shared_down is not None:
        shared = F.linear(F.silu(F.linear(x_NH, moe.shared_gate)) * F.linear(x_NH, moe.shared_up), moe.shared_down)
        out = out + torch.sigmoid(F.linear(x_NH, moe.shared_expert_gate)) * shared
    return out.view(xn.shape)


@contextlib.contextmanager
def recording(layers: list[object]) -> Iterator[list[list[torch.Tensor]]]:
    """Within the block, every MoE call appends its expert ids [N, k] to its layer's list (one list per MoE
    layer, in layer order)."""
    moes = [lw.moe for lw in layers if getattr(lw, "moe", None) is not None]
    sinks: list[list[torch.Tensor]] = [[] for _ in moes]
    for moe, sink in zip(moes, sinks):
        moe.sink = sink
    try:
        yield sinks
    finally:
        for moe in moes:
            moe.sink = None


def has_moe(layers: list[object]) -> bool:
    return any(getattr(lw, "moe", None) is not None for lw in layers)


def route_buffer(layers: list[object], rows: int, cols: int, device: torch.device) -> torch.Tensor | None:
    """[rows, cols, moe layers, k] int16 zeros for recorded routes; None for a dense model."""
    moes = [lw.moe for lw in layers if getattr(lw, "moe", None) is not None]
    if not moes:
        return None
    return torch.zeros(rows, cols, len(moes), moes[0].top_k, dtype=torch.int16, device=device)


def stacked(sinks: list[list[torch.Tensor]], *lead: int) -> torch.Tensor:
    """The last call's expert ids of every MoE layer as [*lead, moe layers, k] int16."""
    return torch.stack([s[-1] for s in sinks], dim=1).view(*lead, len(sinks), -1).to(torch.int16)


def record_routes(run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object], layers: list[object],
                  ids_BL: torch.Tensor, mask_BL: torch.Tensor, pos_BL: torch.Tensor, rows_per_call: int
                  ) -> torch.Tensor:
    """`routed_experts` [B, L, moe layers, k] (int16): the experts each token is routed to when `run(ids, mask,
    pos)` (a prefill over `rows_per_call` rows at a time) forwards the rows; pads route too (ignored downstream)."""
    B, L = ids_BL.shape
    chunks = []
    for i in range(0, B, rows_per_call):
        rows = slice(i, i + rows_per_call)
        with recording(layers) as sinks:
            run(ids_BL[rows], mask_BL[rows], pos_BL[rows])
        n = ids_BL[rows].shape[0]
        chunks.append(torch.stack([s[0].view(n, L, -1) for s in sinks], dim=2).to(torch.int16))
    return torch.cat(chunks)
