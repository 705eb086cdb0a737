"""The routers' load-balancing loss of MoE models (Switch Transformer's auxiliary loss, as transformers computes it
for Qwen3-MoE, Qwen2-MoE and Mixtral), added to the training loss with `EngineSpec.moe_aux_loss_coef`.

loss = E · Σ_e f_e · P_e over one forward's real tokens, every MoE layer pooled (HF pools the layers' router logits
before reducing): f_e = top-k assignments to expert e per token (Σ_e f_e = k), P_e = mean router probability of e.
f is counted, so only P carries gradient: it moves probability from over-used experts to under-used ones. A
uniform router scores k; one that sends every token to the same k experts scores E.

Decision: forward hooks on the router modules keep each MoE layer's logits during one forward and the loss is
computed after it, instead of HF's `output_router_logits=True`:
- our forward runs the backbone, not HF's causal-LM forward where HF computes this loss, and packs the rows into
  one (HF's loss masks with a [B, L] attention mask): the loss is ours either way, over the tokens that are real
  (packed: every token the model saw; padded: the attention mask); the hooks hand it the logits as HF's own
  output recorder does (forward hooks on the router modules), with no family-specific forward argument;
- the hooks run no op inside the decoder layer, so with gradient checkpointing the recomputed layer saves what the
  forward saved, and they are switched off before backward, so the recomputation records nothing; they are
  installed once and switched (`_LogitSink`), so compiled decoder layers keep them;
- routing replay's hook replaces the chosen experts but not the logits: the loss is a function of the trainer
  router's logits alone (its probabilities and its own top-k), replay only fixes which experts run;
- FSDP2: the logits also feed the routing scores and so the layer's output, so autograd runs the router's backward
  only after the main path reached it through the layer's output, i.e. after FSDP2's pre-backward unshard.
Probabilities are fp32 (HF's function uses the logits' dtype, bf16 in training; the routers themselves use fp32).

Legend: N tokens the model sees (B*L padded, or the real ones packed), E experts, k experts per token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from hybridflow.engine.moe_replay import router_hooks, routers

AUX_LOSS = "moe_aux_loss"  # the forward's loss (a scalar) among the engine's outputs
METRIC = "moe/aux_loss"
MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral")  # whose HF routers and loss this follows
CONFIG_KEY = "actor.moe.aux_loss_coef"


def check_model(module: nn.Module, coef: float) -> None:
    """Refuse a coefficient > 0 for a model without the routers this loss is defined for."""
    if coef <= 0:
        return
    model_type = getattr(module.config, "model_type", None)
    if model_type not in MODEL_TYPES or not routers(module):
        raise ValueError(f"{CONFIG_KEY}={coef}: the load-balancing loss needs a Mixture-of-Experts model "
                         f"({', '.join(MODEL_TYPES)}), but this one is model_type={model_type!r}; set "
                         f"{CONFIG_KEY}=0")


class _LogitSink:
    """What the routers' hooks write to (`moe_replay.router_hooks`): on only during a forward that wants the loss.
    The list is the same object throughout (cleared, not replaced) so the compiled code's guards on it hold."""

    def __init__(self) -> None:
        self.on = False
        self.seen: list[torch.Tensor] = []


_SINK = "_hybridflow_router_logits"


def _sink_hook(sink: _LogitSink, j: int, mod: nn.Module, args: tuple, out: tuple) -> None:
    if sink.on:
        sink.seen.append(out[0])


@contextlib.contextmanager
def router_logits(module: nn.Module, enabled: bool) -> Iterator[list[torch.Tensor]]:
    """Around one forward of `module`: yields a list that holds, after it, each MoE layer's router logits [N, E] in
    layer order (empty when not `enabled`). Call it around every forward of an MoE model (also with `enabled`
    false): the first call installs the hooks, before any compiled layer is traced."""
    out: list[torch.Tensor] = []
    gates = routers(module)
    if not gates:
        yield out
        return
    sink = router_hooks(module, gates, _SINK, _LogitSink, _sink_hook)
    if not enabled:
        yield out
        return
    sink.seen.clear()
    sink.on = True
    try:
        yield out
    finally:
        sink.on = False
        out.extend(sink.seen)
        sink.seen.clear()


def load_balancing_loss(logits: Sequence[torch.Tensor], top_k: int, real_N: torch.Tensor | None) -> torch.Tensor:
    """E · Σ_e f_e · P_e over the tokens where `real_N` is true (None: all), the layers' `logits` [N, E] pooled."""
    n, num_experts = logits[0].shape
    w_N = torch.ones(n, device=logits[0].device) if real_N is None else real_N.reshape(-1).float()
    if w_N.numel() != n:
        raise ValueError(f"router logits cover {n} tokens but the real-token mask {w_N.numel()}")
    counts_E = torch.zeros(num_experts, device=w_N.device)
    probs_E = torch.zeros(num_experts, device=w_N.device)
    for layer_NE in logits:
        p_NE = torch.softmax(layer_NE.float(), dim=-1)
        chosen = p_NE.detach().topk(top_k, dim=-1).indices  # [N, k]
        counts_E = counts_E.index_add(0, chosen.flatten(), w_N.repeat_interleave(top_k))
        probs_E = probs_E + w_N @ p_NE
    rows = w_N.sum().clamp(min=1) * len(logits)
    return num_experts * ((counts_E / rows) * (probs_E / rows)).sum()
