"""GRPO on a simulated two-node Ray cluster (two raylets on this machine, one CPU slot each, gloo): one rank per
node, both writing one shared checkpoint directory; the node of rank 1 removed mid-run ends the run `failed` naming
node, rank and stage; a resume with a freshly joined node continues from the last checkpoint.

One cluster and one test: starting raylets dominates the cost (~30 s on a loaded 2-core machine).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
from ppo_testlib import tiny_ppo_config

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from hybridflow.controller import WorkerError  # noqa: E402
from hybridflow.tracking.jsonl import read_events  # noqa: E402
from hybridflow.trainer.ppo import PPOTrainer  # noqa: E402
from hybridflow.trainer.run import run_ppo  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

# Ray pickles functions of importable modules by reference; this test module is not importable in the actors.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():  # a Ray started by another test module of this process is not this cluster
        ray.shutdown()
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node_of(host: Any) -> str:
    return ray.get_runtime_context().get_node_id()


def rank_nodes(trainer: PPOTrainer) -> list[str]:
    handles = trainer.groups.owners[0]._handles  # noqa: SLF001 - the test asks each actor where it runs
    return ray.get([h.__ray_call__.remote(_node_of) for h in handles], timeout=60)


def test_grpo_across_two_nodes_node_loss_then_resume(cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    ckpt, run_dir = tmp_path / "shared_ckpt", tmp_path / "run"
    cfg = tiny_ppo_config(tmp_path, ckpt, 2, "trainer.backend=ray", "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
                          f"trainer.ray_address={cluster.address}", "trainer.logger=[]", f"trainer.run_dir={run_dir}",
                          "trainer.total_training_steps=3", "trainer.checkpoint.save_freq=1",
                          "trainer.checkpoint.async_save=false")
    worker_node = next(iter(cluster.worker_nodes))
    head, worker = cluster.head_node.node_id, worker_node.node_id
    seen: dict[int, list[str]] = {}
    step = PPOTrainer.step

    def step_with_node_loss(self: PPOTrainer, batch: Any) -> dict[str, float]:
        seen[self.global_step] = rank_nodes(self)
        if self.global_step == 3 and worker_node in cluster.worker_nodes:  # steps 1-2 saved; rank 1's node goes
            cluster.remove_node(worker_node)
        return step(self, batch)

    monkeypatch.setattr(PPOTrainer, "step", step_with_node_loss)
    caplog.set_level(logging.INFO, logger="hybridflow.controller.backends.ray")

    # 1. steps 1-2 with rank 0 on the driver's (head) node and rank 1 on the other; node lost in step 3's generation
    with pytest.raises(WorkerError) as info:
        run_ppo(cfg)
    assert seen[1] == seen[2] == [head, worker], (seen, head, worker)
    topology = [r.getMessage() for r in caplog.records if "on resource pool 'global_pool'" in r.getMessage()]
    assert topology and "node 0 " in topology[0] and f"node id {head[:8]}, driver) rank 0" in topology[0], topology
    assert "node 1 " in topology[0] and f"node id {worker[:8]}) rank 1" in topology[0], topology
    err = info.value
    assert err.rank == 1 and worker[:8] in err.node and err.stage == "gen", str(err)
    end = [e for e in read_events(run_dir) if e["kind"] == "run_end"][-1]
    assert end["status"] == "failed" and end["rank"] == 1 and worker[:8] in end["node"] and end["stage"] == "gen", end
    assert end["step"] == 2 and "died" in end["error"], end

    # both ranks (on two nodes) wrote their files into the one shared checkpoint directory
    for step_dir in ("global_step_1", "global_step_2"):
        ranks = sorted(p.name for p in (ckpt / step_dir / "ranks").iterdir())
        assert ranks == ["rank_00000.json", "rank_00001.json"], (step_dir, ranks)
    assert not (ckpt / "global_step_3").exists()

    # 2. a new node joins; the same command resumes from step 2 and trains step 3 with rank 1 there
    fresh = cluster.add_node(num_cpus=1).node_id
    cluster.wait_for_nodes()
    history = run_ppo(cfg)
    assert [round(m["training/global_step"]) for m in history] == [3], [m.get("training/global_step") for m in history]
    assert seen[3] == [head, fresh], (seen[3], head, fresh)
    assert (ckpt / "global_step_3" / "ranks" / "rank_00001.json").is_file()
    ends = [e["status"] for e in read_events(run_dir) if e["kind"] == "run_end"]
    assert ends[-2:] == ["failed", "finished"], ends
    assert json.loads((ckpt / "global_step_3" / "extra.json").read_text())["global_step"] == 3
