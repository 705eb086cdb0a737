"""FSDP2 wrapping (one `fully_shard` per decoder layer + the root), mixed precision, and CPU offload moves.

Decision: master weights stay in `fsdp.param_dtype` (float32 by default) and compute runs in the model dtype
(bf16 on GPU, fp32 on CPU) through `MixedPrecisionPolicy`. Offload is explicit and between phases (verl style:
parameters and optimizer state are moved to CPU while another role or the rollout owns the GPU), not FSDP's
per-layer CPUOffloadPolicy, so the optimizer step still runs on the GPU — except with
`optimizer_offload=cpu_step`, where the step and the fp32 masters live on the host (`host_optim.py`).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`model.dtype`: auto = bf16 on GPU, fp32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}: must be auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


def build_mesh(device: torch.device) -> DeviceMesh:
    """1-D data-parallel mesh over the whole world."""
    return init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    base = model.base_model
    base = getattr(base, "language_model", base)  # vision-language models: the text decoder's layers
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers at model.base_model.layers")
    return list(layers)


def apply_fsdp2(model: torch.nn.Module, mesh: DeviceMesh, compute_dtype: torch.dtype, reduce_dtype: torch.dtype,
                reshard_after_forward: bool = True) -> torch.nn.Module:
    """Shard `model` in place; returns it (its class becomes FSDP<Model>)."""
    # Master dtype = that of the trained parameters (LoRA: fp32 adapters over a frozen compute-dtype base).
    master = next((p for p in model.parameters() if p.requires_grad), next(model.parameters())).dtype
    mp = None
    if compute_dtype != master or reduce_dtype != master:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=True)
    kwargs = {"mesh": mesh} if mp is None else {"mesh": mesh, "mp_policy": mp}
    if mesh.size() == 1 and reshard_after_forward:
        # One rank: "resharding" frees the unsharded compute-dtype copy after forward only to cast it again
        # for backward. Keep it; the rollout's weight view reshards before generating (weights.py).
        reshard_after_forward = False
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed again at once in backward: keep them gathered.
        fully_shard(layer, reshard_after_forward=reshard_after_forward and i < len(layers) - 1, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    return model


def move_model(model: torch.nn.Module, device: torch.device) -> None:
    """Move sharded parameters (and gradients) to `device`; FSDP2 keeps its sharding metadata. Unsharded
    copies left by a forward without resharding are freed first."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
    model.to(device)
    for p in model.parameters():
        if p.grad is not None and p.grad.device != p.device:
            p.grad = p.grad.to(p.device, non_blocking=True)


def move_optimizer(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Move optimizer state tensors (exp_avg, exp_avg_sq; `step` too for the fused optimizer, which keeps it beside
    the parameters; otherwise it stays on CPU) to `device`."""
    keep_step = not all(group.get("fused") for group in optimizer.param_groups)
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and not (key == "step" and keep_step):
                state[key] = value.to(device, non_blocking=True)
