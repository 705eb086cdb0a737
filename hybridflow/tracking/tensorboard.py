"""TensorBoard backend: scalars under their metric names, events and the config as text, in run_dir/tensorboard."""

from __future__ import annotations

from hybridflow.tracking.base import TRACKERS, Backend, Event, RunContext, import_optional

TB_SUBDIR = "tensorboard"


@TRACKERS.register("tensorboard")
class TensorBoardBackend(Backend):
    name = "tensorboard"

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        import_optional("tensorboard", "tensorboard")
        tb = import_optional("torch.utils.tensorboard", "tensorboard", "tensorboard")
        self.log_dir = ctx.run_dir / TB_SUBDIR
        self.writer = tb.SummaryWriter(log_dir=str(self.log_dir))
        if ctx.config:
            import yaml

            text = yaml.safe_dump(ctx.config, sort_keys=False, default_flow_style=False)
            self.writer.add_text("config", f"```yaml\n{text}\n```", global_step=0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def event(self, event: Event) -> None:
        self.writer.add_text(f"events/{event.kind}", f"**{event.level}**: {event.message}", global_step=event.step)

    def close(self) -> None:
        self.writer.close()
