"""The one Hugging Face exporter (safetensors + config.json + tokenizer), for a checkpoint or a live engine.

`write_hf` writes a model state dict: full weights as they are; LoRA adapters (with any trained head) as a PEFT
adapter directory, or merged into the base model rebuilt from `model.path` / `model.preset`. A `score.weight`
marks a scalar-head model (reward model, critic), written as token classification. `export_hf` feeds it a
checkpoint's `model/*` tensors, read as full CPU tensors in one process (DCP shards of any world size); the
model config and chat template come from the run's config saved in the checkpoint's `extra["config"]`.
`SupervisedWorker.export_hf` feeds it the engine's gathered state.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from hybridflow.checkpoint import atomic
from hybridflow.checkpoint.storage import read_flat_tensors

if TYPE_CHECKING:
    from hybridflow.config.schema import ModelConfig

logger = logging.getLogger(__name__)

MODEL_PREFIX = "model/"


def full_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Unsharded CPU copies of a (DTensor-sharded) state dict; collective: every rank calls it."""
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in state.items()}


def write_hf(state: dict[str, torch.Tensor], model_cfg: ModelConfig, out_dir: str | Path, *, merge: bool = True,
             dtype: torch.dtype | None = None, tokenizer: Any = None, chat_template: str | None = None
             ) -> tuple[Path, str]:
    """Write `state` as an HF directory; returns (directory, kind: "full", "merged" or "peft_adapter"). With a
    `tokenizer`, it is saved carrying `chat_template` (`data.chat_template`, see `hybridflow.data.templates`)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
    )

    from hybridflow.data.templates import save_tokenizer
    from hybridflow.engine.lora import is_adapter_param, merge_adapters, save_adapter_dir, targets_from_state
    from hybridflow.models.heads import scalar_head_config
    from hybridflow.models.loader import load_module, model_config, save_model

    adapters = {k: v for k, v in state.items() if is_adapter_param(k)}
    scalar = "score.weight" in state
    if adapters and not model_cfg.lora.enabled:
        raise ValueError("the model holds LoRA adapters but model.lora.rank=0 in the config used; pass the run's "
                         "config (with its model.lora.*) to hybridflow export")
    if adapters and not merge:
        out = save_adapter_dir(out_dir, state, model_cfg.lora, targets_from_state(state), model_cfg.path)
        return out, "peft_adapter"
    if adapters:  # the frozen base is rebuilt; trained non-adapter tensors (a scalar head) replace its own
        base = load_module(model_cfg, "value" if scalar else "lm", dtype=torch.float32).state_dict()
        rest = {k: v for k, v in state.items() if k not in adapters}
        state = merge_adapters({**base, **rest}, adapters, model_cfg.lora.alpha / model_cfg.lora.rank)
    hf_config = scalar_head_config(model_config(model_cfg)) if scalar else model_config(model_cfg)
    names = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES if scalar else MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if names.get(hf_config.model_type):
        hf_config.architectures = [names[hf_config.model_type]]
    out = save_model(out_dir, hf_config, state, None, dtype)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out, chat_template)
    return out, "merged" if adapters else "full"


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """A complete `global_step_<N>` dir as given, or the latest complete one under a checkpoint root."""
    p = Path(path)
    latest = p if atomic.is_complete(p) else atomic.find_latest(p)
    if latest is None:
        raise ValueError(f"--checkpoint {path}: neither a complete checkpoint (global_step_<N> with "
                         f"{atomic.MARKER}) nor a directory holding one")
    return latest


def export_hf(checkpoint: str | Path, out_dir: str | Path, *, component: str = "actor",
              model_cfg: ModelConfig | None = None, dtype: torch.dtype | None = None, merge: bool = False,
              chat_template: str | None = None) -> Path:
    """Write `component`'s model of `checkpoint` to `out_dir` (see `write_hf`; LoRA: a PEFT adapter directory
    unless `merge`); returns `out_dir`. `model_cfg` and `chat_template` default to the run's, saved in the
    checkpoint; a `model_cfg` given without `chat_template` means the tokenizer's own template."""
    from hybridflow.config.loader import build
    from hybridflow.config.schema import ModelConfig
    from hybridflow.models.loader import load_tokenizer

    ckpt = resolve_checkpoint_dir(checkpoint)
    meta = atomic.read_json(ckpt / atomic.MARKER)
    if component not in meta["components"]:
        raise ValueError(f"--component {component}: {ckpt} holds {sorted(meta['components'])}")
    if model_cfg is None:
        saved = atomic.read_json(ckpt / "extra.json").get("config") or {}
        if saved.get("model") is None:
            raise ValueError(f"{ckpt}/extra.json has no 'config' (saved by the trainer); pass the run's config "
                             "(hybridflow export --checkpoint DIR --out HF_DIR run.yaml [a.b=c ...])")
        model_cfg = build(ModelConfig, saved["model"], "model")
        chat_template = (saved.get("data") or {}).get("chat_template")
    flat = read_flat_tensors(ckpt / component, meta["components"][component]["format"], MODEL_PREFIX)
    if not flat:
        raise ValueError(f"{ckpt}/{component} has no '{MODEL_PREFIX}*' tensors; is it a model component?")
    state = {k[len(MODEL_PREFIX):]: v for k, v in flat.items()}
    if merge and not any(".lora_A." in k for k in state):
        logger.warning("--merge ignored: %s/%s holds full weights (no LoRA adapters), exported as they are", ckpt,
                       component)
    out, kind = write_hf(state, model_cfg, out_dir, merge=merge, dtype=dtype, tokenizer=load_tokenizer(model_cfg),
                         chat_template=chat_template)
    (out / "hybridflow_export.json").write_text(json.dumps(
        {"checkpoint": str(ckpt.resolve()), "step": meta["step"], "component": component, "kind": kind}, indent=1))
    logger.info("exported %s (%s, step %d) to %s (%s)", ckpt, component, meta["step"], out, kind)
    return out
