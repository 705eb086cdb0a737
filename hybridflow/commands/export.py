"""`hybridflow export --checkpoint DIR --out HF_DIR [--merge] [CONFIG.yaml ...] [a.b=c ...]`: checkpoint → HF model
dir (LoRA checkpoints: a PEFT adapter dir, or with `--merge` base + adapters as one HF model)."""

from __future__ import annotations

import argparse

import torch

from hybridflow.commands.common import add_config_args, fail, load_from_args

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    from hybridflow.checkpoint.export import export_hf
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
