"""SwanLab backend. Mode: `SWANLAB_MODE` when set; else cloud if `SWANLAB_API_KEY` is set, else offline
(files under run_dir/swanlog, `swanlab sync` later)."""

from __future__ import annotations

import logging
import os

from hybridflow.tracking.base import TRACKERS, Backend, RunContext, import_optional

logger = logging.getLogger(__name__)


def swanlab_mode() -> str:
    if os.environ.get("SWANLAB_MODE"):
        return os.environ["SWANLAB_MODE"]
    return "online" if os.environ.get("SWANLAB_API_KEY") else "offline"


@TRACKERS.register("swanlab")
class SwanlabBackend(Backend):
    name = "swanlab"

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        self._swanlab = import_optional("swanlab", "swanlab")
        mode = swanlab_mode()
        self.log_dir = ctx.run_dir / "swanlog"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        logger.info("swanlab: mode %s, logs in %s", mode, self.log_dir)
        self.run = self._swanlab.init(project=ctx.project, name=ctx.experiment, config=ctx.config,
                                      log_dir=str(self.log_dir), mode=mode)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._swanlab.log(dict(metrics), step=step)

    def close(self) -> None:
        self._swanlab.finish()
