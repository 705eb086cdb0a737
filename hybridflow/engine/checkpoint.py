"""Engine state for checkpoints: the sharded model + optimizer state dicts (DCP-ready) that `TrainEngine.state_dict`
returns and `hybridflow.checkpoint` writes, and `export_hf`, which gathers a full state dict on rank 0 and writes
the HF format (safetensors + config + tokenizer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from transformers import PreTrainedTokenizerBase

from hybridflow.engine.host_optim import HostOptimizer
from hybridflow.models.loader import save_model

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


def export_hf(model: torch.nn.Module, out_dir: str | Path, tokenizer: PreTrainedTokenizerBase | None,
              dtype: torch.dtype | None = None,
              transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None) -> None:
    """Full (unsharded) weights in HF format, written by rank 0; all ranks must call it. `transform` maps the full
    state dict before it is written (LoRA: merge the adapters)."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        if transform is not None:
            full = transform(full)
        config = model.config.__class__.from_dict(model.config.to_dict())
        config.architectures = [type(model).__name__.removeprefix("FSDP")]
        save_model(out_dir, config, full, tokenizer, dtype)
    dist.barrier()
