"""Tracking and observability: `Tracker` fan-out over backends (console, jsonl, tensorboard, wandb, mlflow,
swanlab), health watermarks, run info, and the HTML report drawn from run_dir/metrics.jsonl."""

from hybridflow.tracking.base import TRACKERS, Backend, Event, MissingTrackerPackage, RunContext
from hybridflow.tracking.health import HealthEvent, HealthMonitor
from hybridflow.tracking.run_info import collect_versions, write_run_info
from hybridflow.tracking.tracker import Tracker, build_tracker

__all__ = ["TRACKERS", "Backend", "Event", "HealthEvent", "HealthMonitor", "MissingTrackerPackage", "RunContext",
           "Tracker", "build_tracker", "collect_versions", "write_run_info"]
