"""`hybridflow export --checkpoint DIR --out HF_DIR [--merge] [CONFIG.yaml ...] [a.b=c ...]`: checkpoint → HF model
dir (LoRA checkpoints: a PEFT adapter dir, or with `--merge` base + adapters as one HF model), through the one HF
writer (`hybridflow.engine.checkpoint.write_hf`). The `model/*` tensors are read as full CPU tensors in one process
(DCP shards of any world size); the model config and chat template come from the run's config saved in the
checkpoint's `extra["config"]`."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hybridflow.commands.common import add_config_args, fail, load_from_args

if TYPE_CHECKING:
    from hybridflow.config.schema import ModelConfig

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MODEL_PREFIX = "model/"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="a global_step_<N> directory, or a checkpoint root (its latest is used)")
    parser.add_argument("--out", required=True, help="output Hugging Face model directory")
    parser.add_argument("--component", default="actor", help="checkpoint component holding the model (default actor)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                        help="cast floating weights (default: as saved)")
    parser.add_argument("--merge", action="store_true",
                        help="LoRA checkpoints: write base + adapters merged as a plain HF model (default: a PEFT "
                             "adapter dir, adapter_config.json + adapter_model.safetensors)")
    add_config_args(parser)  # only needed when the checkpoint does not carry the run's config


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_from_args(args.args) if args.args else None
        out = export_hf(args.checkpoint, args.out, component=args.component, model_cfg=cfg and cfg.model,
                        chat_template=cfg and cfg.data.chat_template,
                        dtype=_DTYPES[args.dtype] if args.dtype else None, merge=args.merge)
    except (ValueError, FileNotFoundError) as err:
        return fail(err)
    kind = "PEFT adapter" if (out / "adapter_config.json").is_file() else "Hugging Face model"
    print(f"wrote {kind} to {out}")
    return 0


def export_hf(checkpoint: str | Path, out_dir: str | Path, *, component: str = "actor",
              model_cfg: ModelConfig | None = None, dtype: torch.dtype | None = None, merge: bool = False,
              chat_template: str | None = None) -> Path:
    """Write `component`'s model of `checkpoint` to `out_dir` (LoRA: a PEFT adapter directory
    unless `merge`); returns `out_dir`. `model_cfg` and `chat_template` default to the run's, saved in the
    checkpoint; a `model_cfg` given without `chat_template` means the tokenizer's own template."""
    from hybridflow.checkpoint import atomic
    from hybridflow.checkpoint.storage import read_flat_tensors
    from hybridflow.config.loader import build
    from hybridflow.config.schema import ModelConfig
    from hybridflow.engine.checkpoint import write_hf
    from hybridflow.models.loader import load_tokenizer

    ckpt = Path(checkpoint) if atomic.is_complete(Path(checkpoint)) else atomic.find_latest(Path(checkpoint))
    if ckpt is None:
        raise ValueError(f"--checkpoint {checkpoint}: neither a complete checkpoint (global_step_<N> with "
                         f"{atomic.MARKER}) nor a directory holding one")
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
