"""Training on a simulated three-node Ray cluster (three raylets on this machine, gloo; the head has two CPU slots,
the others one). PPO with a critic (GAE), one rank per node, checkpoints mirrored to an fsspec remote (`file://`,
standing in for object storage): the node of rank 2 removed mid-run ends the run `failed` naming node, rank and
stage; with the local checkpoints gone and a freshly joined node, the same command resumes from the remote with
bit-exact actor and critic state. GRPO on two nodes samples and trains as on one node (both ranks on the head), and
resumes its own step-1 checkpoint bit-exact.

One cluster for the module: starting the raylets and the workers dominates the cost (each run spends 25-60 s
bringing up its workers on a loaded 2-core machine; the steps take seconds). The GRPO resume reuses the run's
workers (now at step 2) instead of starting new ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ppo_testlib import deterministic_metrics, tiny_ppo_config

ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")

from hybridflow.controller import WorkerError  # noqa: E402
from hybridflow.tracking.jsonl import read_events  # noqa: E402
from hybridflow.trainer.ppo import PPOTrainer  # noqa: E402
from hybridflow.trainer.roles import WorkerGroups  # noqa: E402
from hybridflow.trainer.run import run_ppo  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

# Ray pickles functions of importable modules by reference; this test module is not importable in the actors.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():  # a Ray started by another test module of this process is not this cluster
        ray.shutdown()
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.add_node(num_cpus=1)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node_and_state(host: Any) -> tuple[str, str]:
    """Inside a colocated worker: its node, and a digest of its actor and critic shards and optimizer states."""
    import torch

    digest = hashlib.sha256()
    for role, name in (("actor_rollout_ref", "actor"), ("critic", "critic")):
        engine = getattr(host.worker.roles[role], name)
        tensors = [p for p in engine.module.parameters()]
        tensors += [t for s in engine.optimizer.state_dict()["state"].values() for t in s.values()
                    if isinstance(t, torch.Tensor)]
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            digest.update(local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return ray.get_runtime_context().get_node_id(), digest.hexdigest()


def _join_weight_group(host: Any, address: tuple[str, int]) -> tuple[str, str]:
    """Inside a worker on another node than actor rank 0: join its weight group as the one receiver, as a rollout
    worker of trainer.mode=one_step_off does (`RolloutWorker.join_weight_group`)."""
    import torch

    from hybridflow.workers.weight_collective import WeightReceiver

    host.weight_receiver = WeightReceiver(tuple(address), 1, 2, torch.device("cpu"), 60.0)
    return host.weight_receiver.backend, ray.get_runtime_context().get_node_id()


def _receive_weights(host: Any, msg: Any) -> dict[str, Any]:
    buckets, _seconds = host.weight_receiver.receive(msg)
    return {name: t.clone() for bucket in buckets for name, t in bucket.tensors()}


def check_weight_group_across_nodes(trainer: PPOTrainer) -> None:
    """The collective weight transport's group (actor rank 0 → one receiver on another node, gloo) forms at the
    address rank 0 publishes (its node's IP, never loopback) and carries the weights bit-exact."""
    import torch

    hosts = trainer.groups.owners[0]._handles  # noqa: SLF001
    address = trainer.groups.actor.open_weight_sender(1, 60.0)[0]
    assert address[0] == ray.util.get_node_ip_address() and not address[0].startswith("127."), address
    joined = hosts[2].__ray_call__.remote(_join_weight_group, address)
    msg, _finished = trainer.groups.actor.stage_weights(1 << 14)[0]
    backend, node = ray.get(joined, timeout=60)
    assert backend == "gloo" and node != ray.get_runtime_context().get_node_id(), (backend, node)
    held = ray.get(hosts[2].__ray_call__.remote(_receive_weights, msg), timeout=60)
    sent = {name: t for bucket in trainer.groups.actor.weight_buckets(1 << 30)[0] for name, t in bucket.tensors()}
    assert len(msg.specs) > 1 and sorted(held) == sorted(sent), (len(msg.specs), sorted(held))
    for name, t in sent.items():
        assert torch.equal(held[name].view(torch.uint8), t.contiguous().view(torch.uint8)), name


def rank_nodes_and_states(trainer: PPOTrainer) -> list[tuple[str, str]]:
    handles = trainer.groups.owners[0]._handles  # noqa: SLF001 - the test asks each actor where it runs
    return ray.get([h.__ray_call__.remote(_node_and_state) for h in handles], timeout=60)


def test_ppo_gae_across_three_nodes_node_loss_then_resume_from_remote(
        cluster: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    ckpt, remote, run_dir = tmp_path / "ckpt", tmp_path / "object_store", tmp_path / "run"
    cfg = tiny_ppo_config(tmp_path, ckpt, 3, "algorithm.adv_estimator=gae", "data.train_batch_size=3",
                          "trainer.backend=ray", "trainer.nnodes=3", "trainer.n_gpus_per_node=1",
                          f"trainer.ray_address={cluster.address}", "trainer.logger=[]", f"trainer.run_dir={run_dir}",
                          "trainer.total_training_steps=3", "trainer.checkpoint.save_freq=1",
                          "trainer.checkpoint.async_save=false", f"trainer.default_hdfs_dir=file://{remote}")
    head = cluster.head_node.node_id
    seen: dict[tuple[int, int], list[tuple[str, str]]] = {}  # (run, step) -> per rank (node, state digest)
    run = {"n": 1}
    step = PPOTrainer.step

    def step_with_node_loss(self: PPOTrainer, batch: Any) -> dict[str, float]:
        seen[run["n"], self.global_step] = rank_nodes_and_states(self)
        if run["n"] == 1 and self.global_step == 3:  # steps 1-2 saved and mirrored; rank 2's node goes
            lost = seen[1, 3][2][0]
            cluster.remove_node(next(n for n in cluster.worker_nodes if n.node_id == lost))
        if run["n"] == 2:
            check_weight_group_across_nodes(self)
        return step(self, batch)

    monkeypatch.setattr(PPOTrainer, "step", step_with_node_loss)
    caplog.set_level(logging.INFO, logger="hybridflow.controller.backends.ray")

    # 1. steps 1-2: rank 0 on the driver's (head) node, ranks 1-2 on the others in node-id order (one IP here)
    workers = sorted(n.node_id for n in cluster.worker_nodes)
    with pytest.raises(WorkerError) as info:
        run_ppo(cfg)
    for s in (1, 2):
        assert [node for node, _ in seen[1, s]] == [head, *workers], (seen[1, s], head, workers)
    assert seen[1, 1] != seen[1, 2]  # the digests see the update (and both roles' steps)
    topology = [r.getMessage() for r in caplog.records if "on resource pool 'global_pool'" in r.getMessage()]
    assert topology and "3 node(s), 3 rank(s)" in topology[0], topology
    for rank, node in enumerate([head, *workers]):
        assert f"node {rank} " in topology[0] and f"node id {node[:8]}" in topology[0], topology
    lost = workers[1]
    err = info.value
    assert err.rank == 2 and lost[:8] in err.node and err.stage == "gen", str(err)
    end = [e for e in read_events(run_dir) if e["kind"] == "run_end"][-1]
    assert end["status"] == "failed" and end["rank"] == 2 and lost[:8] in end["node"] and end["step"] == 2, end

    # the three ranks (on three nodes) wrote one checkpoint per step, mirrored whole to the remote
    for root in (ckpt, remote):
        for step_dir in ("global_step_1", "global_step_2"):
            ranks = sorted(p.name for p in (root / step_dir / "ranks").iterdir())
            assert ranks == [f"rank_0000{r}.json" for r in range(3)], (root, step_dir, ranks)
            meta = json.loads((root / step_dir / "checkpoint.json").read_text())
            assert sorted(meta["components"]) == ["actor", "critic"] and meta["world_size"] == 3, meta
        assert not (root / "global_step_3").exists()
    assert (remote / "latest").read_text().strip() == "global_step_2"

    # 2. the local checkpoints are lost with the node; a new node joins; the same command resumes from the remote
    shutil.rmtree(ckpt)
    fresh = cluster.add_node(num_cpus=1).node_id
    cluster.wait_for_nodes()
    run["n"] = 2
    history = run_ppo(cfg)
    assert [round(m["training/global_step"]) for m in history] == [3], [m.get("training/global_step") for m in history]
    assert [node for node, _ in seen[2, 3]] == [head, *sorted([workers[0], fresh])], (seen[2, 3], fresh)
    # every rank's actor and critic shards and optimizer states are bit-exact those the interrupted run had
    assert [d for _, d in seen[2, 3]] == [d for _, d in seen[1, 3]]
    assert (ckpt / "global_step_2" / "checkpoint.json").is_file()  # downloaded: the local copy was deleted
    ends = [e["status"] for e in read_events(run_dir) if e["kind"] == "run_end"]
    assert ends[-2:] == ["failed", "finished"], ends
    for root in (ckpt, remote):
        assert json.loads((root / "global_step_3" / "extra.json").read_text())["global_step"] == 3
        assert len(list((root / "global_step_3" / "ranks").iterdir())) == 3


def _node_of(host: Any) -> str:
    return ray.get_runtime_context().get_node_id()


def _grpo(tmp: Path, cluster: Any, name: str, nnodes: int, *extra: str,
          groups: WorkerGroups | None = None) -> tuple[PPOTrainer, list[torch.Tensor]]:
    """A GRPO trainer of two ranks on `nnodes` nodes (on `groups` when given), and the list its training steps'
    responses are recorded in."""
    cfg = tiny_ppo_config(tmp, tmp / "grpo_ckpt", 2, "algorithm.adv_estimator=grpo", "trainer.backend=ray",
                          f"trainer.nnodes={nnodes}", f"trainer.n_gpus_per_node={2 // nnodes}",
                          f"trainer.ray_address={cluster.address}", "trainer.logger=[]",
                          f"trainer.run_dir={tmp / name}", "trainer.checkpoint.async_save=false", *extra)
    trainer, responses = PPOTrainer(cfg, groups=groups), []
    generate = trainer.algorithm.generate

    def recording(batch: Any, metrics: dict[str, float]) -> Any:
        out = generate(batch, metrics)
        responses.append(out.batch["responses"].clone())
        return out

    trainer.algorithm.generate = recording
    return trainer, responses


def _rank_nodes(trainer: PPOTrainer) -> list[str]:
    handles = trainer.groups.owners[0]._handles  # noqa: SLF001 - the test asks each actor where it runs
    return ray.get([h.__ray_call__.remote(_node_of) for h in handles], timeout=60)


def _same_metrics(expected: dict[str, float], got: dict[str, float]) -> None:
    """Every training metric of `expected` (not wall clock, not validation: only a run's last step validates) is
    in `got` bit for bit."""
    expected = {k: v for k, v in deterministic_metrics(expected).items() if not k.startswith("val/")}
    assert set(expected) <= set(got), set(expected) - set(got)
    for key, value in expected.items():
        assert got[key] == value or (value != value and got[key] != got[key]), (key, value, got[key])  # NaN == NaN


def test_grpo_across_two_nodes_equals_one_node_and_resumes(cluster: Any, tmp_path: Path) -> None:
    head = cluster.head_node.node_id
    # 1. the reference: both ranks on the head node (two slots), one step
    one, one_rows = _grpo(tmp_path, cluster, "one_node", 1, "trainer.total_training_steps=1",
                          "trainer.checkpoint.save_freq=0")
    try:
        assert _rank_nodes(one) == [head, head]
        reference = one.fit()
    finally:
        one.close()

    # 2. one rank per node, two steps, a checkpoint each: step 1 samples the same tokens and logs the same metrics
    two, rows = _grpo(tmp_path, cluster, "two_nodes", 2, "trainer.total_training_steps=2",
                      "trainer.checkpoint.save_freq=1")
    resumed = None
    try:
        nodes = _rank_nodes(two)
        assert nodes[0] == head and nodes[1] != head, (nodes, head)
        history = two.fit()
        assert [m["training/global_step"] for m in history] == [1, 2]
        assert len(rows) == 2 and torch.equal(rows[0], one_rows[0]) and not torch.equal(rows[0], rows[1])
        _same_metrics(reference[0], history[0])
        ranks = sorted(p.name for p in (tmp_path / "grpo_ckpt" / "global_step_1" / "ranks").iterdir())
        assert ranks == ["rank_00000.json", "rank_00001.json"], ranks

        # 3. the same ranks (holding step 2's weights) resume from step 1's checkpoint: step 2 again, bit-exact
        two.ckpt.close()  # `resumed` takes over the groups (and closes them)
        two.algorithm.reward_fn.close()
        resumed, again = _grpo(tmp_path, cluster, "resumed", 2, "trainer.total_training_steps=2",
                               "trainer.checkpoint.save_freq=0", "trainer.resume_mode=path",
                               f"trainer.resume_path={tmp_path / 'grpo_ckpt' / 'global_step_1'}", groups=two.groups)
        repeated = resumed.fit()
        assert [m["training/global_step"] for m in repeated] == [2] and len(again) == 1
        assert torch.equal(again[0], rows[1])
        _same_metrics(history[1], repeated[0])
    finally:
        (resumed or two).close()
