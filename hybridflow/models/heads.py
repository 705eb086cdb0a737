"""Scalar heads: the critic's value head and the reward model's score head are one design.

Decision: both are HF `AutoModelForTokenClassification` with `num_labels=1`, no bias and no dropout, i.e. the
backbone plus `score = Linear(hidden, 1, bias=False)`. That is exactly the head of HF
`*ForSequenceClassification` reward models, so their checkpoints load unchanged, while the per-token output lets
packed (padding-free) forward passes work. A critic reads the value at every response position; a reward model
reads the value at the last valid token.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForTokenClassification, PretrainedConfig, PreTrainedModel

logger = logging.getLogger(__name__)

SCALAR_HEAD_ROLES = ("critic", "reward")


def scalar_head_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of a causal-LM config turned into the scalar-head config (num_labels=1, no bias, no dropout)."""
    cfg = config.__class__.from_dict(config.to_dict())
    cfg.num_labels = 1
    cfg.classifier_dropout = 0.0
    cfg.token_classification_bias = False
    cfg.architectures = None
    return cfg


def scalar_head_from_config(config: PretrainedConfig, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A randomly initialised backbone + scalar head."""
    return AutoModelForTokenClassification.from_config(scalar_head_config(config), dtype=dtype)


def scalar_head_from_pretrained(path: str, *, dtype: torch.dtype = torch.float32, trust_remote_code: bool = False,
                                attn_implementation: str | None = None) -> PreTrainedModel:
    """Backbone + scalar head from a local directory holding a causal LM (head freshly initialised, as for a critic
    started from the actor) or a token/sequence-classification checkpoint (head loaded)."""
    from transformers import AutoConfig

    base = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForTokenClassification.from_pretrained(
        path, config=scalar_head_config(base), dtype=dtype, trust_remote_code=trust_remote_code, **kwargs,
    )
    return model


def value_head(model: PreTrainedModel) -> torch.nn.Linear:
    """The scalar head module of a model built here."""
    head = getattr(model, "score", None)
    if not isinstance(head, torch.nn.Linear) or head.out_features != 1:
        raise ValueError(f"{type(model).__name__} has no scalar `score` head; build it with hybridflow.models.heads")
    return head
