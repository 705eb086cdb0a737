"""`hybridflow export`: a checkpoint's model as a Hugging Face directory, through the one HF writer
(`hybridflow.engine.checkpoint.write_hf`). The `model/*` tensors are read as full CPU tensors in one process (DCP
shards of any world size); the model config and chat template come from the run's config saved in the
checkpoint's `extra["config"]`."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridflow.checkpoint import atomic
from hybridflow.checkpoint.storage import read_flat_tensors
from hybridflow.engine.checkpoint import write_hf

if TYPE_CHECKING:
    from hybridflow.config.schema import ModelConfig

logger = logging.getLogger(__name__)

MODEL_PREFIX = "model/"


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
    """Write `component`'s model of `checkpoint` to `out_dir` (LoRA: a PEFT adapter directory
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
