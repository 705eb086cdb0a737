"""Weights & Biases backend. Without credentials it runs offline (files under run_dir/wandb, `wandb sync` later).

Mode: `WANDB_MODE` when set; else online if an API key is configured (`WANDB_API_KEY` or a netrc login), else
offline — never an interactive login prompt in the middle of a training launch.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from hybridflow.tracking.base import TRACKERS, Backend, Event, RunContext, import_optional

logger = logging.getLogger(__name__)


def wandb_mode() -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="replace"):
        return "online"
    return "offline"


@TRACKERS.register("wandb")
class WandbBackend(Backend):
    name = "wandb"

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        wandb = import_optional("wandb", "wandb")
        mode = wandb_mode()
        if mode == "offline":
            logger.info("wandb: no API key found, logging offline to %s/wandb (upload later with `wandb sync`)",
                        ctx.run_dir)
        ctx.run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=ctx.project, name=ctx.experiment, config=ctx.config, dir=str(ctx.run_dir),
                              mode=mode, reinit="finish_previous")
        self._events: list[list[object]] = []

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def event(self, event: Event) -> None:
        self._events.append([event.step, event.kind, event.level, event.message])

    def close(self) -> None:
        if self._events:
            import wandb

            self.run.log({"events": wandb.Table(columns=["step", "kind", "level", "message"], data=self._events)})
        self.run.finish()
