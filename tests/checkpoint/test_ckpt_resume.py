"""Exact resume of a toy training loop: 6 steps == 3 steps + save + fresh process state + load + 3 steps.

The loop uses every RNG a trainer touches (torch for dropout and data, numpy and python for sampling), an
optimizer, an LR scheduler and a data position, so the checkpoint must hold all of them for bit-exact equality.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from hybridflow.checkpoint import CheckpointManager, find_resume_checkpoint
from hybridflow.data.dataloader import DataPosition

STEPS_PER_EPOCH = 2


class Toy:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=6)
        self.pos = DataPosition(0, 0)
        self.losses: list[float] = []

    def step(self) -> None:
        noise = np.random.rand() + random.random()
        x = torch.randn(16, 4) + noise
        loss = (self.model(x).squeeze(-1) - x.sum(-1)).pow(2).mean()
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        self.losses.append(loss.item())
        self.pos = DataPosition(self.pos.epoch, self.pos.batch + 1).normalized(STEPS_PER_EPOCH)

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict()}

    def load(self, comp: dict) -> None:
        self.model.load_state_dict(comp["model"])
        self.opt.load_state_dict(comp["optimizer"])
        self.sched.load_state_dict(comp["scheduler"])


def _seed_all(seed: int) -> None:
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)


def test_six_steps_equal_three_plus_resume_plus_three(tmp_path: Path) -> None:
    _seed_all(7)
    full = Toy()
    for _ in range(6):
        full.step()

    _seed_all(7)
    first = Toy()
    for _ in range(3):
        first.step()
    with CheckpointManager(tmp_path, async_save=True) as mgr:
        mgr.save(3, {"actor": first.state()}, extra={"data": first.pos.to_dict(), "losses": first.losses})

    _seed_all(12345)  # a new process: different RNG, fresh model
    second = Toy()
    mgr = CheckpointManager(tmp_path)
    path = find_resume_checkpoint(mgr, "auto")
    loaded = mgr.load(path, templates={"actor": second.state()})
    second.load(loaded.components["actor"])
    second.pos = DataPosition.from_dict(loaded.extra["data"], STEPS_PER_EPOCH)
    second.losses = list(loaded.extra["losses"])
    assert loaded.step == 3 and second.pos == DataPosition(1, 1)
    for _ in range(3):
        second.step()

    assert second.losses == full.losses  # bit-exact, not approximately
    assert second.pos == full.pos == DataPosition(3, 0)
    for a, b in zip(full.model.parameters(), second.model.parameters()):
        assert torch.equal(a, b)
    assert full.sched.get_last_lr() == second.sched.get_last_lr()
