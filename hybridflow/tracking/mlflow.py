"""MLflow backend through `MlflowClient` (no global active-run state).

Tracking URI: `MLFLOW_TRACKING_URI` when set, else a local file store at run_dir/mlruns (works offline; mlflow ≥3
wants `MLFLOW_ALLOW_FILE_STORE=true` for it, which this backend sets for its own default store only). The config is
logged as flattened params plus a config.yaml artifact; events go to an events.jsonl artifact at close.
"""

from __future__ import annotations

import json
import logging
import os
import time

from hybridflow.tracking.base import TRACKERS, Backend, Event, RunContext, flatten, import_optional

logger = logging.getLogger(__name__)

_MAX_PARAM_LEN = 500  # mlflow rejects longer param values on older servers
_BATCH = 100  # mlflow log_batch limit for params


@TRACKERS.register("mlflow")
class MlflowBackend(Backend):
    name = "mlflow"

    def __init__(self, ctx: RunContext) -> None:
        super().__init__(ctx)
        import_optional("mlflow", "mlflow", "mlflow-skinny")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (ctx.run_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri
        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(ctx.project)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(ctx.project)
        self.run_id = self.client.create_run(exp_id, run_name=ctx.experiment).info.run_id
        params = [Param(k, str(v)[:_MAX_PARAM_LEN]) for k, v in flatten(ctx.config).items()]
        for i in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + _BATCH])
        if ctx.config:
            self.client.log_dict(self.run_id, ctx.config, "config.yaml")
        self._events: list[str] = []
        logger.info("mlflow: run %s at %s", self.run_id, uri)

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, step) for key, value in metrics.items()]
        for i in range(0, len(batch), 1000):  # mlflow log_batch limit for metrics
            self.client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def event(self, event: Event) -> None:
        self._events.append(json.dumps(event.to_dict()))

    def close(self) -> None:
        if self._events:
            self.client.log_text(self.run_id, "\n".join(self._events) + "\n", "events.jsonl")
        self.client.set_terminated(self.run_id)
