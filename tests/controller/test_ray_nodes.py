"""Which Ray node hosts each entry of `process_on_nodes` (`backends/ray_nodes.py`), against hand-written nodes."""

from __future__ import annotations

import pytest

from hybridflow.controller.backends.ray_nodes import NodeSlots, assign_nodes, cluster_nodes, topology_line


def _raw(node_id: str, ip: str, cpus: float, gpus: float = 0.0, alive: bool = True) -> dict:
    res = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Alive": alive, "Resources": res}


def test_driver_node_first_then_by_ip_dead_nodes_skipped_gpus_capped_by_cpus():
    raw = [_raw("c" * 56, "10.0.0.10", 16, 8), _raw("a" * 56, "10.0.0.9", 16, 8), _raw("d" * 56, "10.0.0.2", 16, 8,
           alive=False), _raw("b" * 56, "10.0.0.11", 4, 8)]
    nodes = cluster_nodes(raw, "GPU", driver_node_id="b" * 56, held={"a" * 56: 3})
    assert [(n.ip, n.total, n.free, n.driver) for n in nodes] == [
        ("10.0.0.11", 4, 4, True), ("10.0.0.9", 8, 5, False), ("10.0.0.10", 8, 8, False)]  # 9 < 10: numeric order


def test_one_node_per_entry_in_order_and_topology_line():
    nodes = [NodeSlots("h" * 56, "10.0.0.1", 8, 8, True), NodeSlots("w" * 56, "10.0.0.2", 8, 8)]
    chosen = assign_nodes("global_pool", [8, 8], nodes, "GPU")
    assert [n.node_id for n in chosen] == ["h" * 56, "w" * 56]
    line = topology_line("colocated", "global_pool", chosen, [8, 8])
    assert line == ("worker group 'colocated' on resource pool 'global_pool': 2 node(s), 16 rank(s): node 0 10.0.0.1 "
                    "(node id hhhhhhhh, driver) ranks 0-7; node 1 10.0.0.2 (node id wwwwwwww) ranks 8-15")
    # a second pool goes where the first left room: the full driver node is skipped
    full = [NodeSlots("h" * 56, "10.0.0.1", 8, 0, True), NodeSlots("w" * 56, "10.0.0.2", 8, 8)]
    assert [n.ip for n in assign_nodes("rollout_pool", [2], full, "GPU")] == ["10.0.0.2"]


def test_too_few_nodes_names_them_and_the_fix():
    nodes = [NodeSlots("h" * 56, "10.0.0.1", 2, 2, True)]
    with pytest.raises(ValueError) as info:
        assign_nodes("global_pool", [1, 1], nodes, "CPU")
    msg = str(info.value)
    assert "needs 2 node(s)" in msg and "has 1" in msg and "10.0.0.1 (node id hhhhhhhh, driver): 2 of 2" in msg, msg
    assert "ray start --address=" in msg and "trainer.nnodes=1" in msg, msg


def test_node_too_small_names_the_node_and_the_key():
    nodes = [NodeSlots("h" * 56, "10.0.0.1", 8, 8, True), NodeSlots("w" * 56, "10.0.0.2", 4, 4)]
    with pytest.raises(ValueError) as info:  # [8] * 2 written for a cluster whose second node has 4 GPUs
        assign_nodes("global_pool", [8, 8], nodes, "GPU")
    msg = str(info.value)
    assert "process_on_nodes[1]=8" in msg and "node 10.0.0.2 (node id wwwwwwww) with 4 of 4 free" in msg, msg
    assert "trainer.n_gpus_per_node (or resource_pool.process_on_nodes[1]) to at most 4" in msg, msg
