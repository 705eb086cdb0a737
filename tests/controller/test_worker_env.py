"""Ray workers start from the raylet's environment: the driver's HYBRIDFLOW_* settings travel in the runtime_env."""

from __future__ import annotations

from types import SimpleNamespace

from hybridflow.controller.backends import ray as ray_backend
from hybridflow.controller.worker import WORKER_BASE_ENV, worker_base_env


def test_init_ray_carries_the_drivers_hybridflow_settings(monkeypatch):
    seen = {}
    monkeypatch.setattr(ray_backend.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_backend.ray, "init", lambda **kw: seen.update(kw))
    monkeypatch.setattr(ray_backend.ray, "cluster_resources", lambda: {})
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("HYBRIDFLOW_FP8_GEMM", "rowwise")
    monkeypatch.setenv("HYBRIDFLOW_PEAK_TFLOPS", "400")
    ray_backend.init_ray(runtime_env={"env_vars": {"HYBRIDFLOW_PEAK_TFLOPS": "989", "MY_VAR": "1"}})
    env = seen["runtime_env"]["env_vars"]
    assert env["HYBRIDFLOW_FP8_GEMM"] == "rowwise"
    assert env["HYBRIDFLOW_PEAK_TFLOPS"] == "989" and env["MY_VAR"] == "1"  # the user's runtime_env wins
    assert all(env[k] == v for k, v in WORKER_BASE_ENV.items())
    assert not any(k.startswith("PATH") for k in env)  # only HYBRIDFLOW_* of the driver's environment


def test_actors_get_the_settings_when_the_job_lacks_them(monkeypatch):
    monkeypatch.delenv("HYBRIDFLOW_FP8_GEMM", raising=False)
    job = {"env_vars": worker_base_env()}  # what init_ray gave the job
    monkeypatch.setattr(ray_backend.ray, "get_runtime_context", lambda: SimpleNamespace(runtime_env=job))
    assert ray_backend._actor_runtime_env() is None  # the job's env has everything: no per-actor env
    monkeypatch.setenv("HYBRIDFLOW_FP8_GEMM", "tensorwise")  # set after the job (e.g. a cluster joined later)
    assert ray_backend._actor_runtime_env()["env_vars"]["HYBRIDFLOW_FP8_GEMM"] == "tensorwise"
    job["env_vars"]["HYBRIDFLOW_FP8_GEMM"] = "rowwise"  # the job's (the user's runtime_env) value wins
    assert ray_backend._actor_runtime_env() is None
