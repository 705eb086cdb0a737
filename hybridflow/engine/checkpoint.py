"""Engine state for checkpoints: the sharded model + optimizer state dicts (DCP-ready) that `TrainEngine.state_dict`
returns and `hybridflow.checkpoint` writes, and the one Hugging Face writer of a model state, `write_hf` (used by
`hybridflow export` on a checkpoint and by the supervised trainers on the live engine).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
)

from hybridflow.data.templates import save_tokenizer
from hybridflow.engine.host_optim import HostOptimizer
from hybridflow.engine.lora import (
    is_adapter_param,
    merge_adapters,
    merged_state_dict,
    save_adapter_dir,
    targets_from_state,
)
from hybridflow.models.heads import scalar_head_config
from hybridflow.models.loader import load_image_processor, load_module, model_config, save_model
from hybridflow.utils.tokenizer_protocol import Tokenizer

if TYPE_CHECKING:
    from hybridflow.config.schema import ModelConfig

logger = logging.getLogger(__name__)


def get_engine_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                     trainable_only: bool = False) -> dict[str, Any]:
    """{"model": sharded state, "optimizer": sharded state (trained engines)}: DCP-ready. `trainable_only` (LoRA)
    keeps only the trained parameters (adapters, a scalar head): the frozen base is rebuilt from the model."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=trainable_only))
    return {"model": model_sd, "optimizer": optim_sd}


def set_engine_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any],
                     trainable_only: bool = False) -> None:
    if optimizer is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={})
        return
    # trainable_only: the state holds the trained parameters only; the frozen base keeps its loaded weights.
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=StateDictOptions(strict=not trainable_only))


def get_host_step_state(model: torch.nn.Module, host: HostOptimizer, trainable_only: bool = False) -> dict[str, Any]:
    """`get_engine_state` for `fsdp.optimizer_offload=cpu_step`: the trained parameters' entries are the host's
    full-precision masters (not the device's compute-dtype copies), the optimizer entries its AdamW state; same
    names and layout as the device step's checkpoint."""
    model_sd = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trainable_only))
    return {"model": {**model_sd, **host.model_entries()}, "optimizer": host.optimizer_state()}


def set_host_step_state(model: torch.nn.Module, host: HostOptimizer, state: dict[str, Any]) -> None:
    trained = set(host.fqns)
    rest = {k: v for k, v in state["model"].items() if k not in trained}
    if rest:  # frozen weights (LoRA base, when saved) and buffers
        set_model_state_dict(model, rest, options=StateDictOptions(strict=False))
    host.load(state["model"], state["optimizer"])


def full_model_state(model: torch.nn.Module, lora_scale: float | None = None, *, keep: bool = True
                     ) -> dict[str, torch.Tensor]:
    """The unsharded CPU model state (collective: every rank calls it, with its parameters on the device); with
    `lora_scale` (alpha / rank) the adapters are merged into the in-memory base weights, a plain model's state.
    Parameters are gathered one at a time; a rank with `keep=False` (not the writer) drops each one after the
    collective and gets `{}` — one full copy on the host in all, not one per rank."""
    state = {}
    for k, v in get_model_state_dict(model).items():
        full = v.full_tensor() if isinstance(v, DTensor) else v
        if keep:
            state[k] = full.detach().cpu()
    if not keep or lora_scale is None:
        return state
    return merged_state_dict(state, lora_scale)


def write_hf(state: dict[str, torch.Tensor], model_cfg: ModelConfig, out_dir: str | Path, *, merge: bool = True,
             dtype: torch.dtype | None = None, tokenizer: Tokenizer | None = None, chat_template: str | None = None
             ) -> tuple[Path, str]:
    """Write `state` as an HF directory; returns (directory, kind: "full", "merged" or "peft_adapter"). With a
    `tokenizer`, it is saved carrying `chat_template` (`data.chat_template`, see `hybridflow.data.templates`); a
    vision-language model's image processor is saved beside it."""
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
    image_processor = None if scalar else load_image_processor(model_cfg)
    if image_processor is not None:  # a vision-language model's directory is loadable as `model.path` again
        image_processor.save_pretrained(str(out))
    return out, "merged" if adapters else "full"
