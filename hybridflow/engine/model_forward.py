"""The engine's forward: backbone → hidden states → (chunked log-probs | scalar values) at response positions.

Decision: it runs *inside* the root module's forward (installed as an instance-level `forward` that falls back to
HF's forward unless `hf_request` is given), so FSDP2's root hooks unshard/reshard lm_head and embeddings and
reduce their gradients as usual, while the full [tokens, vocab] logits are never built (like verl's fused path).
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.engine import invariant
from hybridflow.engine.attention import CU_SEQLENS, MAX_SEQLEN
from hybridflow.engine.logprobs import chunked_logprobs
from hybridflow.engine.packing import ModelInputs
from hybridflow.protocol import keys

HEADS = ("lm", "value", "score")


@dataclass(frozen=True)
class HeadRequest:
    kind: str  # lm: log-probs (+entropy) of labels; value: scalar head at src positions; score: at last tokens
    temperature: float = 1.0
    chunk_size: int = 1024
    with_entropy: bool = False


def _engine_forward(self: torch.nn.Module, inputs: ModelInputs, req: HeadRequest) -> dict[str, torch.Tensor]:
    kwargs: dict[str, Any] = {}
    exact = invariant.installed(self)
    position_ids = inputs.position_ids
    if inputs.cu_seqlens is not None:
        kwargs = {CU_SEQLENS: inputs.cu_seqlens, MAX_SEQLEN: inputs.max_seqlen}
    elif exact:
        raise ValueError("actor_rollout.exact_logprobs=true needs packed forwards; set data.use_packed_dataset=true")
    if exact:
        kwargs[invariant.EXACT_KWARG] = True
    if inputs.vision is not None:  # the vision tower runs here; HF computes the 3-D rope positions (get_rope_index)
        kwargs, position_ids = dict(inputs.vision), None
    out = self.base_model(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask,
                          position_ids=position_ids, use_cache=False, **kwargs)
    hidden = out.last_hidden_state
    hidden_NH = hidden.reshape(-1, hidden.shape[-1])
    idle = idle_tower_zero(self) if inputs.idle_tower and inputs.vision is None else None
    if req.kind == "lm" and getattr(self.config, "final_logit_softcapping", None):
        res = _softcapped_logprobs(self, hidden_NH.index_select(0, inputs.src_K), inputs.labels_K, req)
        return _plus(res, "log_probs", idle)
    if req.kind == "lm":
        logp, ent = chunked_logprobs(hidden_NH.index_select(0, inputs.src_K), self.get_output_embeddings(),
                                     inputs.labels_K, temperature=req.temperature, chunk_size=req.chunk_size,
                                     with_entropy=req.with_entropy, exact=exact)
        res = {"log_probs": logp} if ent is None else {"log_probs": logp, keys.ENTROPY: ent}
        return _plus(res, "log_probs", idle)
    idx = inputs.src_K if req.kind == "value" else inputs.last_K
    # sum over the single output column: a fresh tensor, not a view (FSDP2 output hooks dislike views).
    return _plus({keys.VALUES: self.score(hidden_NH.index_select(0, idx)).float().sum(-1)}, keys.VALUES, idle)


def idle_tower_zero(model: torch.nn.Module) -> torch.Tensor | None:
    """A zero that depends on every trainable vision-tower parameter (None without grad, tower or trainable ones).

    Why: the tower sits in the root FSDP2 group (`fsdp.apply_fsdp2`), and FSDP2 reduce-scatters only the parameters
    that got a gradient. When a micro-batch holds no image on one rank but images on another, their reduce-scatters
    would differ in size (a hang, or gradients mixed up). Added to the outputs of the image-less one, this term gives
    the tower a zero gradient there, so every rank reduces the same parameters and the average is the images'
    gradient over all ranks. It runs inside the root's forward, where the parameters are the unsharded ones FSDP2
    reduces. The engine asks for it only then (`TrainEngine._mini_batch_sums`): with no image on any rank the
    tower keeps no gradient, and the optimizer leaves it alone, as before."""
    if not torch.is_grad_enabled():
        return None
    params = trainable_tower_params(model)
    if not params:
        return None
    return torch.stack([p.sum().float() for p in params]).sum() * 0.0


def trainable_tower_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The vision tower's trainable parameters (none for a text model, or a frozen tower)."""
    tower = getattr(model.base_model, "visual", None)
    return [] if tower is None else [p for p in tower.parameters() if p.requires_grad]


def _plus(out: dict[str, torch.Tensor], key: str, zero: torch.Tensor | None) -> dict[str, torch.Tensor]:
    if zero is not None:
        out[key] = out[key] + zero.to(out[key].dtype)
    return out


def _softcapped_logprobs(self: torch.nn.Module, hidden_KH: torch.Tensor, labels_K: torch.Tensor,
                         req: HeadRequest) -> dict[str, torch.Tensor]:
    """Gemma-2-style final logit soft-capping (c·tanh(logits / c), as HF's forward applies it): plain [K, V] logits
    and autograd instead of the chunked kernel, which knows no soft-cap."""
    cap = float(self.config.final_logit_softcapping)
    logits_KV = self.get_output_embeddings()(hidden_KH).float()
    logp_KV = torch.log_softmax(torch.tanh(logits_KV / cap) * cap / req.temperature, dim=-1)
    out = {"log_probs": logp_KV.gather(-1, labels_K[:, None]).squeeze(-1)}
    if req.with_entropy:
        out[keys.ENTROPY] = -(logp_KV.exp() * logp_KV).sum(-1)
    return out


def install_engine_forward(model: torch.nn.Module) -> None:
    """Make `model(hf_inputs=..., hf_request=...)` run `_engine_forward`; any other call is HF's forward."""
    if getattr(model, "_hf_engine_forward", False):
        return
    original = model.forward

    def forward(self: torch.nn.Module, *args: Any, hf_inputs: ModelInputs | None = None,
                hf_request: HeadRequest | None = None, **kwargs: Any) -> Any:
        if hf_request is None:
            return original(*args, **kwargs)
        if hf_request.kind not in HEADS:
            raise ValueError(f"head kind {hf_request.kind!r} must be one of {HEADS}")
        return _engine_forward(self, hf_inputs, hf_request)

    # HF generate checks its model kwargs (a VLM's pixel_values...) against forward's signature: keep the original's
    sig = inspect.signature(original)
    params = [p for p in sig.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    extra = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None) for n in ("hf_inputs", "hf_request")]
    rest = [p for p in sig.parameters.values() if p.kind == inspect.Parameter.VAR_KEYWORD]
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = sig.replace(parameters=[self_param, *params, *extra, *rest])
    model.forward = types.MethodType(forward, model)
    model._hf_engine_forward = True
