"""benchmarks/two_gpu.py on gloo ranks under Ray (CPU): its own file so `--dist loadfile` runs it beside the other
benchmark scripts' tests, not after them."""

from __future__ import annotations

import json

import pytest
from bench_testlib import SMALL, run_module

pytestmark = pytest.mark.slow


def test_two_gpu_benchmark_runs_on_two_gloo_ranks(tmp_path):
    pytest.importorskip("ray")
    run_module("benchmarks.two_gpu", "--device", "cpu", "--case", "grpo:tiny:1", "--case", "grpo:tiny:2", *SMALL,
         "--out", str(tmp_path), timeout=600)
    cases = {c["case"]: c for c in json.loads((tmp_path / "two_gpu.json").read_text())["cases"]}
    assert set(cases) == {"grpo:tiny:1", "grpo:tiny:2"}
    for name, case in cases.items():
        assert "error" not in case, (name, case.get("error"))
    two = cases["grpo:tiny:2"]
    assert two["collectives"]["all_gather"] and two["collectives"]["param_gather_s"] > 0 and two["kill"]["names_dead_rank"], two.get("kill")

def test_four_rank_ppo_colocated_and_split_run_on_gloo(tmp_path):
    """Issue 14's cases on 4 gloo ranks: PPO with a critic colocated (one process per GPU) and split (one process
    per role), the per-process probes (RPC round trip, busy-profile path, update time outside compute), and
    `hybridflow train` to its first step."""
    pytest.importorskip("ray")
    run_module("benchmarks.two_gpu", "--device", "cpu", "--case", "ppo:tiny:4", "--case", "ppo:tiny:4:1:split",
         "--cli-startup", "grpo:tiny:1", "--kill-stage", "none", "--rpc-iters", "5", *SMALL,
         "--out", str(tmp_path), timeout=600)
    report = json.loads((tmp_path / "two_gpu.json").read_text())
    cases = {c["case"]: c for c in report["cases"]}
    assert set(cases) == {"ppo:tiny:4", "ppo:tiny:4:split"}
    for name, case in cases.items():
        assert "error" not in case, (name, case.get("error"))
        assert case["median"]["timing/update_critic"] > 0 and case["rpc_ms"]["p50"] > 0
        assert case["update_critic_outside_compute_s"] is not None
    assert len(cases["ppo:tiny:4"]["ranks_info"]) == 4
    assert "trainer.use_colocated_worker=false" in cases["ppo:tiny:4:split"]["overrides"]
    cli = report["cli_startup"][0]
    assert cli["rc"] == 0 and cli["to_first_step_start_s"] > 0, cli.get("output_tail")
