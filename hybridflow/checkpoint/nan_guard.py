"""NaN/inf guard: skip the optimizer step on a non-finite loss or grad norm, count, and stop after too many.

Every rank must take the same decision (an FSDP step is collective), so `is_finite_everywhere` all-reduces the
flag. After `trainer.max_consecutive_bad_steps` bad steps in a row the guard raises `NonFiniteError`, or, when
rollback is enabled, sets `rollback_requested` for the trainer to act on.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""


def _finite(x: Any) -> bool:
    if x is None:
        return True
    if isinstance(x, torch.Tensor):
        return bool(torch.isfinite(x.detach()).all().item())
    return math.isfinite(float(x))


def is_finite_everywhere(ok: bool, group: dist.ProcessGroup | None = None, device: Any = "cpu") -> bool:
    """All-reduce (MIN) a finiteness flag so every rank skips together; identity when not distributed."""
    if not dist.is_available() or not dist.is_initialized():
        return ok
    if str(device) == "cpu" and dist.get_backend(group) == "nccl":  # NCCL reduces device tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class NonFiniteGuard:
    def __init__(self, max_consecutive_bad_steps: int, rollback_enabled: bool = False) -> None:
        if max_consecutive_bad_steps < 1:
            raise ValueError(f"trainer.max_consecutive_bad_steps={max_consecutive_bad_steps}: must be >= 1")
        self.max_bad = max_consecutive_bad_steps
        self.rollback_enabled = rollback_enabled
        self.consecutive = 0
        self.skipped_total = 0
        self.rollback_requested = False

    def check(self, loss: Any = None, grad_norm: Any = None, step: int | None = None,
              group: dist.ProcessGroup | None = None) -> bool:
        """True → apply the optimizer step; False → skip it (and zero the grads). May raise `NonFiniteError`."""
        ok = _finite(loss) and _finite(grad_norm)
        ok = is_finite_everywhere(ok, group)
        if ok:
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.skipped_total += 1
        logger.warning("non-finite loss=%s or grad_norm=%s at step %s: skipping the optimizer step (%d in a row, "
                       "limit trainer.max_consecutive_bad_steps=%d)", _fmt(loss), _fmt(grad_norm), step,
                       self.consecutive, self.max_bad)
        if self.consecutive >= self.max_bad:
            if self.rollback_enabled:
                self.rollback_requested = True
                self.consecutive = 0
            else:
                raise NonFiniteError(
                    f"{self.max_bad} consecutive steps had a non-finite loss or gradient norm (last at step {step}; "
                    f"{self.skipped_total} skipped in total). Training stopped. Lower the learning rate, check the "
                    "data/rewards for inf/nan, enable trainer.rollback.enable=true to reload the best checkpoint, or "
                    "raise trainer.max_consecutive_bad_steps.")
        return False

    def metrics(self) -> dict[str, float]:
        return {"train/skipped_steps": float(self.skipped_total), "train/consecutive_bad_steps": float(self.consecutive)}

    def state_dict(self) -> dict[str, int]:
        return {"consecutive": self.consecutive, "skipped_total": self.skipped_total}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consecutive, self.skipped_total = int(state["consecutive"]), int(state["skipped_total"])


def _fmt(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return str(x.detach().float().cpu().reshape(-1)[:1].tolist())
    return str(x)
