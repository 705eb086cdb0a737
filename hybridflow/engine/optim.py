"""AdamW and the learning-rate schedule: linear warmup, then constant or cosine decay to `min_lr_ratio`.

Decision: the schedule advances once per training step (`TrainEngine.lr_scheduler_step`, once per
`train_update`), as in verl, so warmup and cosine lengths are counted in trainer steps, not in optimizer
(mini-batch) steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.optim.lr_scheduler import LambdaLR

from hybridflow.config.schema import OptimConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig, fused: bool = False) -> torch.optim.AdamW:
    """`fused` (the engine asks for it on CUDA): one kernel for the whole update, and the skip of a non-finite step
    is decided on the device (`found_inf`, as torch's GradScaler uses it), so a step needs no host read-back. On
    the CPU the multi-tensor (`foreach`) kernels stay: no device to keep busy, and the CPU learning tests' numbers
    were measured with them."""
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(list(params), lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, **kind)


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter group steps with the fused kernel (the one that honours `found_inf`)."""
    return all(group.get("fused") for group in optimizer.param_groups)


def set_kind(optimizer: torch.optim.Optimizer, fused: bool) -> None:
    """Make every parameter group step as this engine's optimizer does, after a checkpoint load: torch's
    `load_state_dict` replaces the groups with the saved ones, flags included, so a checkpoint from a CPU run (or
    from before the fused step) would bring `foreach` back under a fused engine, whose skip flag the multi-tensor
    kernel refuses. The step counts move to where the kind keeps them (fused: float32 beside the parameter;
    foreach: the CPU)."""
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = (True, None) if fused else (None, True)
        for p in group["params"]:
            state = optimizer.state.get(p)
            if state and isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].to(dtype=torch.float32, device=p.device if fused else "cpu")


def warmup_steps(cfg: OptimConfig, total_steps: int | None) -> int:
    if cfg.lr_warmup_steps >= 0:
        return cfg.lr_warmup_steps
    if cfg.lr_warmup_steps_ratio == 0:
        return 0
    if total_steps is None:
        raise ValueError(f"optim.lr_warmup_steps_ratio={cfg.lr_warmup_steps_ratio} needs the total number of "
                         "training steps; pass total_training_steps to the engine or set optim.lr_warmup_steps")
    return int(cfg.lr_warmup_steps_ratio * total_steps)


def lr_factor(step: int, cfg: OptimConfig, warmup: int, total_steps: int | None) -> float:
    """Multiplier of `cfg.lr` for the optimizer steps of training step `step` (0-based)."""
    if step < warmup:
        return (step + 1) / warmup
    if cfg.lr_scheduler == "constant":
        return 1.0
    assert total_steps is not None, "cosine schedule needs total_steps"
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int | None) -> LambdaLR:
    if cfg.lr_scheduler == "cosine" and total_steps is None:
        raise ValueError("optim.lr_scheduler=cosine needs the total number of training steps; pass "
                         "total_training_steps to the engine or use optim.lr_scheduler=constant")
    warmup = warmup_steps(cfg, total_steps)
    return LambdaLR(optimizer, lambda step: lr_factor(step, cfg, warmup, total_steps))
