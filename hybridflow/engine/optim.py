"""AdamW (torch's, or torchao's low-bit / bf16 stochastic-rounding variants) and the learning-rate schedule: linear
warmup, then constant or cosine decay to `min_lr_ratio`.

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

TORCHAO_PIN = "torchao==0.18.0"  # tested with torch 2.13 (CPU); the extra `lowbit`, which `make` installs
# Optimizer state (the two Adam moments) in bytes per parameter; the master weights add fsdp.param_dtype's size.
# torchao quantizes a tensor's moments block-wise (one fp32 scale per block of 256 values at 8 bits, 128 at 4 bits)
# only when it has >= 4096 values divisible by the block; smaller tensors (norms, biases) keep fp32 moments.
# adamw_bf16_sr: moments in the parameters' dtype (bfloat16, which it requires).
STATE_BYTES_PER_PARAM = {"adamw": 8.0, "adamw_8bit": 2 * (1 + 4 / 256), "adamw_4bit": 2 * (0.5 + 4 / 128),
                         "adamw_bf16_sr": 4.0}


def optimizer_state_bytes_per_param(name: str) -> float:
    """Bytes of optimizer state per (quantizable) parameter for `optim.optimizer=name`, master weights excluded."""
    if name not in STATE_BYTES_PER_PARAM:
        raise ValueError(f"optim.optimizer={name!r}: must be one of {', '.join(STATE_BYTES_PER_PARAM)}")
    return STATE_BYTES_PER_PARAM[name]


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig,
                    fused: bool = False) -> torch.optim.Optimizer:
    """`fused` (the engine asks for it on CUDA; torch's AdamW only): one kernel for the whole update, and the skip of
    a non-finite step is decided on the device (`found_inf`, as torch's GradScaler uses it), so a step needs no host
    read-back. On the CPU the multi-tensor (`foreach`) kernels stay: no device to keep busy, and the CPU learning
    tests' numbers were measured with them. Other `cfg.optimizer` values build torchao's optimizers."""
    if cfg.optimizer != "adamw":
        return _build_torchao(list(params), cfg)
    kind = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(list(params), lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, **kind)


class _FloatLR:
    """torchao keeps a group's lr as a tensor (one compiled step for every lr value); our schedule, checkpoint extras
    (JSON) and metrics read floats. The group keeps a float; only torchao's step sees a tensor.
    On the CPU the update runs eagerly: in a standalone check, 3 compiled 8-bit steps (torchao 0.18, inductor) under
    ATEN_CPU_CAPABILITY=avx2 landed 75% of AdamW's step away from AdamW (eager: 0.7%), and compiling takes minutes
    per run on a busy 2-core machine."""

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self.param_groups[-1]["lr"] = float(self.param_groups[-1]["lr"])

    def step(self, closure=None):  # noqa: ANN001, ANN201 - torch's signature
        lrs = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
        cpu = any(p.device.type == "cpu" for group in self.param_groups for p in group["params"])
        try:
            with torch.compiler.set_stance("force_eager" if cpu else "default"):
                return super().step(closure)
        finally:
            for group, lr in zip(self.param_groups, lrs, strict=True):
                group["lr"] = lr


def _build_torchao(params: list[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """On a GPU the update is one `torch.compile`d function per parameter shape, compiled on the first step; on the
    CPU it runs eagerly (`_FloatLR`). torchao is optional, so imported here. bfloat16 parameters are rounded
    stochastically (unbiased; round-to-nearest would drop updates smaller than half a bf16 step)."""
    try:
        from torchao import optim as ao
    except ImportError as e:
        raise ValueError(f"optim.optimizer={cfg.optimizer!r} needs torchao: pip install {TORCHAO_PIN} "
                         "(extra `lowbit`, which `make` installs), or set optim.optimizer=adamw") from e
    base = {"adamw_8bit": ao.AdamW8bit, "adamw_4bit": ao.AdamW4bit, "adamw_bf16_sr": ao._AdamW}[cfg.optimizer]
    cls = type(f"{base.__name__}FloatLR", (_FloatLR, base), {})
    return cls(params, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps, weight_decay=cfg.weight_decay,
               bf16_stochastic_round=True)


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether every parameter group steps with torch's fused kernel (the one that honours `found_inf`)."""
    return isinstance(optimizer, torch.optim.AdamW) and all(group.get("fused") for group in optimizer.param_groups)


def set_kind(optimizer: torch.optim.Optimizer, fused: bool) -> None:
    """Make every parameter group step as this engine's optimizer does, after a checkpoint load: torch's
    `load_state_dict` replaces the groups with the saved ones, flags included, so a checkpoint from a CPU run (or
    from before the fused step) would bring `foreach` back under a fused engine, whose skip flag the multi-tensor
    kernel refuses. The step counts move to where the kind keeps them (fused: float32 beside the parameter;
    foreach: the CPU). torchao's optimizers have one kind: left as loaded."""
    if not isinstance(optimizer, torch.optim.AdamW):
        return
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
