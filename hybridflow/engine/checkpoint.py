"""Engine state for checkpoints: the sharded model + optimizer state dicts (DCP-ready) that `TrainEngine.state_dict`
returns and `hybridflow.checkpoint` writes (and exports as an HF model, `hybridflow.checkpoint.export`)."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from hybridflow.engine.host_optim import HostOptimizer

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

