"""CPU thread defaults: auto = the free cores, explicit settings win, passive OpenMP waits."""

import os
import subprocess
import sys

import pytest
import torch

from hybridflow.commands.common import load_from_args
from hybridflow.config import ConfigError, load_config
from hybridflow.utils.threads import choose_cpu_threads, free_cores


def test_auto_uses_the_cores_not_busy_now() -> None:
    assert free_cores(cpu_count=2, load=0.2) == 2
    assert free_cores(cpu_count=2, load=1.4) == 1
    assert free_cores(cpu_count=2, load=7.0) == 1  # never 0
    assert free_cores(cpu_count=16, load=3.6) == 12
    assert choose_cpu_threads(0, env={}, cpu_count=2, load=5.0) == (1, "auto: 2 cores, load 5.0")


def test_explicit_settings_win_over_auto() -> None:
    assert choose_cpu_threads(3, env={"OMP_NUM_THREADS": "1"})[0] == 3  # the config key first
    assert choose_cpu_threads(0, env={"OMP_NUM_THREADS": "2"}, cpu_count=8, load=7.0) == (2, "OMP_NUM_THREADS")
    assert choose_cpu_threads(0, env={"OMP_NUM_THREADS": ""}, cpu_count=4, load=0.0)[0] == 4


def test_negative_threads_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.cpu_threads"):
        load_config(overrides=["trainer.cpu_threads=-1"])


def test_a_cpu_run_sets_and_states_its_threads(capsys) -> None:
    before = torch.get_num_threads()
    try:
        load_from_args(["trainer.device=cpu", "trainer.cpu_threads=1"], runs=True)
        assert torch.get_num_threads() == 1
        assert "cpu threads: 1 (trainer.cpu_threads=1" in capsys.readouterr().err
        load_from_args(["trainer.device=cpu", "trainer.cpu_threads=2"])  # not a running command: untouched
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_cli_sets_a_passive_openmp_wait_policy_before_torch_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = "import sys, hybridflow.cli, os; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "PASSIVE"
    env["OMP_WAIT_POLICY"] = "ACTIVE"  # a user's choice stays
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "ACTIVE"


def test_a_gpu_run_caps_the_automatic_threads_only() -> None:
    """The host of a GPU run only feeds the device: auto is at most GPU_RUN_THREADS; explicit settings still win."""
    from hybridflow.utils.threads import GPU_RUN_THREADS

    cap = GPU_RUN_THREADS
    assert choose_cpu_threads(0, env={}, cpu_count=16, load=0.0, cap=cap) == (
        cap, f"auto: 16 cores, load 0.0, at most {cap} on a GPU run")
    assert choose_cpu_threads(0, env={}, cpu_count=2, load=0.0, cap=cap) == (2, "auto: 2 cores, load 0.0")
    assert choose_cpu_threads(12, env={}, cpu_count=16, load=0.0, cap=cap)[0] == 12
    assert choose_cpu_threads(0, env={"OMP_NUM_THREADS": "16"}, cpu_count=16, load=0.0, cap=cap)[0] == 16
