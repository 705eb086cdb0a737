"""Export a checkpoint's model weights as a Hugging Face directory (safetensors + config.json + tokenizer).

Reads the component's `model/*` tensors as full CPU tensors in one process (DCP shards of any world size, or
safetensors) — no distributed launch and no optimizer state in memory. The model architecture and tokenizer
come from the run's config stored in the checkpoint's `extra["config"]` (or one passed in); the tokenizer is saved
with the chat template training built its prompts with (`data.chat_template`, see `hybridflow.data.templates`).
A LoRA checkpoint
holds only the adapters: it is written as a PEFT adapter directory, or (`merge=True`) merged into the base model
(rebuilt from `model.path` / `model.preset`) as a plain HF model.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridflow.checkpoint import atomic
from hybridflow.checkpoint.storage import read_flat_tensors

if TYPE_CHECKING:
    from hybridflow.config.schema import ModelConfig

logger = logging.getLogger(__name__)

MODEL_PREFIX = "model/"


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """A complete `global_step_<N>` dir as given, or the latest complete one under a checkpoint root."""
    p = Path(path)
    if atomic.is_complete(p):
        return p
    latest = atomic.find_latest(p)
    if latest is None:
        raise ValueError(f"--checkpoint {path}: neither a complete checkpoint (global_step_<N> with "
                         f"{atomic.MARKER}) nor a directory holding one")
    return latest


def model_config_from_checkpoint(ckpt: Path) -> ModelConfig | None:
    """The `ModelConfig` saved in `extra["config"]["model"]` by the trainer; None when absent."""
    from hybridflow.config.loader import build
    from hybridflow.config.schema import ModelConfig
    section = _saved_config(ckpt).get("model")
    return None if section is None else build(ModelConfig, section, "model")


def chat_template_from_checkpoint(ckpt: Path) -> str | None:
    """The run's `data.chat_template` as saved in the checkpoint's `extra["config"]` (None when absent)."""
    return (_saved_config(ckpt).get("data") or {}).get("chat_template")


def _saved_config(ckpt: Path) -> dict:
    return atomic.read_json(ckpt / "extra.json").get("config") or {}


def export_hf(checkpoint: str | Path, out_dir: str | Path, *, component: str = "actor", model_cfg: ModelConfig | None = None,
              dtype: torch.dtype | None = None, merge: bool = False, chat_template: str | None = None) -> Path:
    """Write `component`'s model of `checkpoint` to `out_dir` as an HF model directory; returns `out_dir`. LoRA
    checkpoints: a PEFT adapter directory, or with `merge` an HF model of base + adapters. `model_cfg` and
    `chat_template` (`data.chat_template`) default to the run's, saved in the checkpoint; a `model_cfg` given
    without `chat_template` means the tokenizer's own template."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from hybridflow.data.templates import save_tokenizer
    from hybridflow.engine.lora import is_adapter_param, merge_adapters, save_adapter_dir, targets_from_state
    from hybridflow.models.loader import load_module, load_tokenizer, model_config, save_model

    ckpt = resolve_checkpoint_dir(checkpoint)
    meta = atomic.read_json(ckpt / atomic.MARKER)
    if component not in meta["components"]:
        raise ValueError(f"--component {component}: {ckpt} holds {sorted(meta['components'])}")
    if model_cfg is None:
        model_cfg, chat_template = model_config_from_checkpoint(ckpt), chat_template_from_checkpoint(ckpt)
    if model_cfg is None:
        raise ValueError(f"{ckpt}/extra.json has no 'config' (saved by the trainer); pass the run's config "
                         "(hybridflow export --checkpoint DIR --out HF_DIR run.yaml [a.b=c ...])")
    flat = read_flat_tensors(ckpt / component, meta["components"][component]["format"], MODEL_PREFIX)
    if not flat:
        raise ValueError(f"{ckpt}/{component} has no '{MODEL_PREFIX}*' tensors; is it a model component?")
    state = {k[len(MODEL_PREFIX):]: v for k, v in flat.items()}
    lora_state = any(is_adapter_param(k) for k in state)
    if lora_state and not model_cfg.lora.enabled:
        raise ValueError(f"{ckpt}/{component} holds LoRA adapters but model.lora.rank=0 in the config used; pass the "
                         "run's config (with its model.lora.*) to hybridflow export")
    if lora_state and not merge:
        out = save_adapter_dir(out_dir, state, model_cfg.lora, targets_from_state(state), model_cfg.path)
        return _record(out, ckpt, meta, component, "peft_adapter")
    if lora_state:
        base = load_module(model_cfg, "lm", dtype=torch.float32).state_dict()
        state = merge_adapters(base, state, model_cfg.lora.alpha / model_cfg.lora.rank)
    elif merge:
        logger.warning("--merge ignored: %s/%s holds full weights (no LoRA adapters), exported as they are", ckpt,
                       component)
    hf_config = model_config(model_cfg)
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
    if arch:
        hf_config.architectures = [arch]
    out = save_model(out_dir, hf_config, state, None, dtype)
    save_tokenizer(load_tokenizer(model_cfg), out, chat_template)
    return _record(out, ckpt, meta, component, "merged" if lora_state else "full")


def _record(out: Path, ckpt: Path, meta: dict, component: str, kind: str) -> Path:
    (out / "hybridflow_export.json").write_text(json.dumps(
        {"checkpoint": str(ckpt.resolve()), "step": meta["step"], "component": component, "kind": kind}, indent=1))
    logger.info("exported %s (%s, step %d) to %s (%s)", ckpt, component, meta["step"], out, kind)
    return out
