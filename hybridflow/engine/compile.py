"""`torch.compile` of each decoder layer for training and log-prob passes (`model.use_torch_compile`).

Decision: compile per layer (torchtitan's habit), before FSDP2 wraps it, so one compiled graph serves every layer
and FSDP2's per-layer hooks stay outside it. At small hidden sizes the eager elementwise kernels (RMSNorm, RoPE,
SwiGLU, casts) cost as much as the matmuls; Inductor fuses them. `auto` = on for CUDA, off on CPU (compiling
there costs more than it saves for the tiny test models).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def wants_compile(setting: bool | str, device: torch.device) -> bool:
    """`model.use_torch_compile` (auto | true | false, checked by the config schema) for `device`."""
    return device.type == "cuda" if setting == "auto" else bool(setting)


def compile_layers(layers: list[torch.nn.Module]) -> None:
    """Compile each layer's forward in place (module identity, parameters and hooks unchanged)."""
    for layer in layers:
        layer.compile()
    logger.info("torch.compile: %d decoder layers (compiled on first use)", len(layers))
