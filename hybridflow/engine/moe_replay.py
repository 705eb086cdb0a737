"""Routing replay for MoE models: the trainer's forward routes each token to the experts the rollout engine chose.

Decision: patch the output of each HF router module (`mlp.gate`, which returns (logits, scores, expert ids)) with a
forward hook, rather than re-implementing the MoE block: the ids become the recorded ones and the scores are
recomputed from the router's own logits at those ids (softmax, renormalised as the family does), so the router
still gets gradients. Each call also measures agreement — whether the router's own top-k equals the recorded set —
so `moe/routing_agreement` is reported with replay on or off. In training the hooks stay through the micro-batch's
backward: gradient checkpointing runs each layer's forward again there, and it must route to the same experts
(another routing saves other tensors, torch's CheckpointError, and would give another routing's gradients).

Legend: B rows, L = P + R columns, N tokens the model sees (B*L padded, or the valid ones packed), M MoE layers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hybridflow.protocol import keys

ROUTED = keys.ROUTED_EXPERTS
AGREEMENT = "routing_agreement"  # per response token: 1.0 where every MoE layer chose the recorded experts


def routers(module: nn.Module) -> list[nn.Module]:
    """The router module of each MoE layer, in layer order (the `moe_layers` axis of `routed_experts`)."""
    inner = getattr(module, "model", module)
    layers = getattr(inner, "layers", None) or []
    return [layer.mlp.gate for layer in layers if hasattr(layer.mlp, "experts") and hasattr(layer.mlp, "gate")]


def _score_rule(module: nn.Module) -> tuple[bool, bool]:
    """(renormalise the k chosen probabilities, keep scores in fp32) as the family's router does."""
    cfg = module.config
    mixtral = cfg.model_type == "mixtral"
    return mixtral or bool(getattr(cfg, "norm_topk_prob", False)), mixtral


class _ReplayState:
    """What the routers' hooks read (`router_hooks`): set for one forward (and its backward), None routes otherwise.
    The same objects are kept (the agreement dict is cleared, not replaced) so the compiled code's guards on them
    hold; None vs a routes tensor is one recompile."""

    def __init__(self) -> None:
        self.routes: torch.Tensor | None = None  # [N, M, k]
        self.replay = False
        self.norm = False
        self.fp32 = False
        self.agree: dict[int, torch.Tensor] = {}


_STATE = "_hybridflow_routing_replay"


def _replay_hook(st: _ReplayState, j: int, mod: nn.Module, args: tuple, output: tuple) -> tuple | None:
    if st.routes is None:
        return None
    logits, _, idx = output
    want = st.routes[:, j].to(idx.dtype)
    assert want.shape == idx.shape, (j, tuple(want.shape), tuple(idx.shape))
    st.agree[j] = (idx.sort(-1).values == want.sort(-1).values).all(-1)
    if not st.replay:
        return None
    scores = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, want)
    if st.norm:
        scores = scores / scores.sum(-1, keepdim=True)
    return logits, scores if st.fp32 else scores.to(logits.dtype), want


def router_hooks(module: nn.Module, gates: list[nn.Module], key: str, make_state: Callable[[], Any],
                 hook: Callable[..., Any]) -> Any:
    """The state `hook(state, j, router, args, output)` reads, one per model under `key`; the first call registers
    the hook on every router (j = its MoE layer) for good. Hooks installed once and switched by state, because a
    `torch.compile`d decoder layer keeps the hooks its first trace saw: one added per forward after a trace without
    it is silently ignored."""
    state = module.__dict__.get(key)
    if state is None:
        state = make_state()
        for j, gate in enumerate(gates):
            gate.register_forward_hook(functools.partial(hook, state, j))
        module.__dict__[key] = state
    return state


@contextlib.contextmanager
def routing_replay(module: nn.Module, routes_BLMk: torch.Tensor | None, mask_BL: torch.Tensor, packed: bool,
                   replay: bool, device: torch.device) -> Iterator[Callable[[], torch.Tensor | None]]:
    """Around one forward of `module` over the rows of `routes_BLMk` (None, or no MoE layer: nothing happens), and
    in training around its backward too (see the module docstring). Yields a function that gives, once the forward
    ran, the per-token agreement [N] (bool, all layers; None without routes). The first call on an MoE model
    installs the routers' hooks (inactive without routes), before any compiled layer is traced."""
    gates = routers(module)
    if not gates:
        yield lambda: None
        return
    st = router_hooks(module, gates, _STATE, _ReplayState, _replay_hook)
    if routes_BLMk is None:
        yield lambda: None
        return
    if routes_BLMk.shape[2] != len(gates):
        raise ValueError(f"routed_experts has {routes_BLMk.shape[2]} MoE layers but the model has {len(gates)}: "
                         "the rollout ran a different model than the trainer")
    routes = routes_BLMk[mask_BL.bool()] if packed else routes_BLMk.flatten(0, 1)  # [N, M, k]
    st.routes = routes.to(device, non_blocking=True)
    st.replay = replay
    st.norm, st.fp32 = _score_rule(module)
    st.agree.clear()

    def agreement() -> torch.Tensor | None:
        agree = st.agree
        return torch.stack([agree[j] for j in range(len(gates))]).all(0) if len(agree) == len(gates) else None

    try:
        yield agreement
    finally:
        st.routes = None
        st.agree.clear()


def metrics(out: dict[str, torch.Tensor], data: dict[str, torch.Tensor]) -> dict[str, float]:
    """`moe/routing_agreement` (fraction of response tokens whose predicting position chose the engine's experts
    in every MoE layer) and `moe/logprob_gap` (mean |trainer − rollout| log-prob); {} for a dense model."""
    if AGREEMENT not in out:
        return {}
    m = data[keys.RESPONSE_MASK].bool()
    n = max(int(m.sum()), 1)
    res = {"moe/routing_agreement": float(out[AGREEMENT][m].sum()) / n}
    if keys.ROLLOUT_LOG_PROBS in data:
        gap = (out["log_probs"].float() - data[keys.ROLLOUT_LOG_PROBS].float()).abs()[m]
        res["moe/logprob_gap"] = float(gap.sum()) / n
    return res
