"""Export a checkpoint's model weights as a Hugging Face directory (safetensors + config.json + tokenizer).

Reads the component's `model/*` tensors as full CPU tensors in one process (DCP shards of any world size, or
safetensors) — no distributed launch and no optimizer state in memory. The model architecture and tokenizer
come from the run's config stored in the checkpoint's `extra["config"]` (or one passed in).
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
    extra = atomic.read_json(ckpt / "extra.json")
    section = (extra.get("config") or {}).get("model")
    return None if section is None else build(ModelConfig, section, "model")


def export_hf(checkpoint: str | Path, out_dir: str | Path, *, component: str = "actor", model_cfg: ModelConfig | None = None,
              dtype: torch.dtype | None = None) -> Path:
    """Write `component`'s model of `checkpoint` to `out_dir` as an HF model directory; returns `out_dir`."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from hybridflow.models.loader import load_tokenizer, model_config, save_model

    ckpt = resolve_checkpoint_dir(checkpoint)
    meta = atomic.read_json(ckpt / atomic.MARKER)
    if component not in meta["components"]:
        raise ValueError(f"--component {component}: {ckpt} holds {sorted(meta['components'])}")
    model_cfg = model_cfg or model_config_from_checkpoint(ckpt)
    if model_cfg is None:
        raise ValueError(f"{ckpt}/extra.json has no 'config' (saved by the trainer); pass the run's config "
                         "(hybridflow export --checkpoint DIR --out HF_DIR run.yaml [a.b=c ...])")
    flat = read_flat_tensors(ckpt / component, meta["components"][component]["format"], MODEL_PREFIX)
    if not flat:
        raise ValueError(f"{ckpt}/{component} has no '{MODEL_PREFIX}*' tensors; is it a model component?")
    state = {k[len(MODEL_PREFIX):]: v for k, v in flat.items()}
    hf_config = model_config(model_cfg)
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf_config.model_type)
    if arch:
        hf_config.architectures = [arch]
    out = save_model(out_dir, hf_config, state, load_tokenizer(model_cfg), dtype)
    (out / "hybridflow_export.json").write_text(json.dumps(
        {"checkpoint": str(ckpt.resolve()), "step": meta["step"], "component": component}, indent=1))
    logger.info("exported %s (%s, step %d) to %s", ckpt, component, meta["step"], out)
    return out
