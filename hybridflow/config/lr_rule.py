"""The learning rate a model's size calls for: `actor.optim.lr: auto` / `critic.optim.lr: auto`, and a warning when an
explicit actor lr is far from it.

Rule (RL fine-tuning with AdamW, full weights): lr = 1e-6 · sqrt(1e9 / parameters), clamped to [1e-6, 1e-4] — verl's
1e-6 for 1B-7B models, 1.4e-6 at 0.5B, 1e-4 for the built-in 0.1M-parameter tiny model (what its tasks train with:
quickstart.yaml, the learning tests). LoRA trains 10× higher (adapters start at zero and are few); a critic 10× the
actor (verl's 1e-5 vs 1e-6). The default stays verl's 1e-6: on the models people fine-tune it is the rule's value.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from hybridflow.config.auto_sizes import model_shape

logger = logging.getLogger(__name__)

AUTO = "auto"
LR_MIN, LR_MAX = 1e-6, 1e-4
FAR = 30.0  # an explicit lr this many times above or below the rule's gets a warning


def rule_lr(params: int, lora: bool = False, critic: bool = False) -> float:
    """The rule's actor (or critic) lr for a model of `params` parameters."""
    lr = min(LR_MAX, max(LR_MIN, 1e-6 * math.sqrt(1e9 / max(params, 1))))
    return lr * (10.0 if lora else 1.0) * (10.0 if critic else 1.0)


def resolve_lr(merged: dict[str, Any]) -> dict[str, Any]:
    """`merged` (the config dict before it is typed) with `auto` lrs set by the rule (a new dict when any was)."""
    sections = [s for s in ("actor", "critic") if _lr(merged, s) == AUTO]
    if not sections:
        return merged
    params = _params(merged, needed=True)
    assert params is not None, "needed=True raises instead"
    lora = _lora(merged)
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in merged.items()}
    for sec in sections:
        out[sec]["optim"] = {**out[sec]["optim"], "lr": rule_lr(params, lora, critic=sec == "critic")}
        logger.info("%s.optim.lr=auto → %.2g for a model of %s parameters%s (config/lr_rule.py)", sec,
                    out[sec]["optim"]["lr"], _size(params), " with LoRA" if lora else "")
    return out


def lr_warning(merged: dict[str, Any]) -> str | None:
    """A warning when the actor's lr is over `FAR`× from the rule's for its model (None when it is not, or when
    the model's size cannot be read). The RL trainer records it as an event at start."""
    lr = _lr(merged, "actor")
    params = _params(merged, needed=False)
    if params is None or not isinstance(lr, int | float) or lr <= 0:
        return None
    lora = _lora(merged)
    want = rule_lr(params, lora)
    ratio = float(lr) / want
    if 1 / FAR <= ratio <= FAR:
        return None
    return (f"actor.optim.lr={lr:.3g} is {max(ratio, 1 / ratio):.0f}× {'above' if ratio > 1 else 'below'} the "
            f"~{want:.1g} a model of {_size(params)} parameters{' with LoRA' if lora else ''} usually trains with: "
            f"{'the policy may diverge' if ratio > 1 else 'the policy may barely move'}. Set actor.optim.lr=auto to "
            "use the size rule (docs/tuning.md), or keep it if you measured it")


def _lora(merged: dict[str, Any]) -> bool:
    return int(merged.get("model", {}).get("lora", {}).get("rank", 0) or 0) > 0


def _lr(merged: dict[str, Any], section: str) -> Any:
    return merged.get(section, {}).get("optim", {}).get("lr")


def _params(merged: dict[str, Any], needed: bool) -> int | None:
    try:
        return int(model_shape(merged)["params"])
    except (OSError, KeyError, ValueError) as err:
        if needed:
            raise ValueError(f"actor.optim.lr=auto sizes the lr from the model's config, which could not be read "
                             f"({type(err).__name__}: {err}); fix model.path or set actor.optim.lr to a number") from err
        return None


def _size(params: int) -> str:
    return f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
