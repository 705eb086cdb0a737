"""Which Ray node hosts each entry of a pool's `process_on_nodes`, checked against what the nodes have.

Plain data in, plain data out (no Ray calls), so the rules are tested without a cluster. Nodes are ordered the
driver's node first, then by IP and node id (stable across restarts of the same machines); entry i takes the first
node not yet used by the pool with room for it. Ranks are numbered node by node, so ranks 0..k-1 share a machine and
FSDP's groups of neighbouring ranks stay inside a node. A pool the cluster cannot hold fails here, naming the node
and the setting to change; Ray itself would wait for the resources forever.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NODE_ID_LABEL = "ray.io/node-id"  # the label every Ray node carries; pins a placement group to one node


@dataclass(frozen=True)
class NodeSlots:
    """One alive Ray node: `total` slots of the pool's kind (GPUs, or CPUs without GPUs), `free` of them not held
    by this driver's other pools."""

    node_id: str
    ip: str
    total: int
    free: int
    driver: bool = False

    @property
    def label(self) -> str:
        return f"{self.ip} (node id {self.node_id[:8]}{', driver' if self.driver else ''})"


def cluster_nodes(raw_nodes: Sequence[Mapping[str, Any]], kind: str, driver_node_id: str,
                  held: Mapping[str, int]) -> list[NodeSlots]:
    """Alive nodes of `ray.nodes()` in placement order; a GPU node's slots are capped by its CPUs (each bundle takes
    one of each). `held`: slots this driver's pools already hold per node id."""
    nodes = []
    for n in raw_nodes:
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        total = int(min(res.get(k, 0.0) for k in ({"GPU", "CPU"} if kind == "GPU" else {"CPU"})))
        node_id = n["NodeID"]
        nodes.append(NodeSlots(node_id, n.get("NodeManagerAddress", "?"), total, total - held.get(node_id, 0),
                               node_id == driver_node_id))
    return sorted(nodes, key=lambda s: (not s.driver, _ip_key(s.ip), s.node_id))


def assign_nodes(pool_name: str, process_on_nodes: Sequence[int], nodes: Sequence[NodeSlots],
                 kind: str) -> list[NodeSlots]:
    """The node of each entry of `process_on_nodes` (one node per entry); `ValueError` naming the node and the fix
    when the cluster cannot hold the pool."""
    usable = [n for n in nodes if n.total > 0]
    listing = "; ".join(f"{n.label}: {n.free} of {n.total} {kind}(s) free" for n in nodes) or "no alive nodes"
    if len(process_on_nodes) > len(usable):
        raise ValueError(
            f"resource pool {pool_name!r}: process_on_nodes={list(process_on_nodes)} needs {len(process_on_nodes)} "
            f"node(s) with {kind}s (trainer.nnodes={len(process_on_nodes)}) but the Ray cluster has {len(usable)}: "
            f"{listing}. Join the missing node(s) with `ray start --address=<head ip>:6379` on each, or set "
            f"trainer.nnodes={max(len(usable), 1)}")
    chosen: list[NodeSlots] = []
    for i, count in enumerate(process_on_nodes):
        node = next((n for n in usable if n not in chosen and n.free >= count), None)
        if node is None:
            rest = [n for n in usable if n not in chosen]
            best = max(rest, key=lambda n: n.free)
            raise ValueError(
                f"resource pool {pool_name!r}: process_on_nodes[{i}]={count} processes on one node, but no node left "
                f"has {count} free {kind}(s); the most is node {best.label} with {best.free} of {best.total} free "
                f"({listing}). Set trainer.n_gpus_per_node (or resource_pool.process_on_nodes[{i}]) to at most "
                f"{best.free}, or release the pools that hold the rest")
        chosen.append(node)
    return chosen


def topology_line(group: str, pool_name: str, nodes: Sequence[NodeSlots], process_on_nodes: Sequence[int]) -> str:
    """`worker group 'g' on pool 'p': node 0 <ip> (node id ..) ranks 0-1; node 1 ...`: logged when a group starts."""
    parts, first = [], 0
    for i, (node, count) in enumerate(zip(nodes, process_on_nodes)):
        ranks = f"rank {first}" if count == 1 else f"ranks {first}-{first + count - 1}"
        parts.append(f"node {i} {node.label} {ranks}")
        first += count
    return (f"worker group {group!r} on resource pool {pool_name!r}: {len(nodes)} node(s), {first} rank(s): "
            + "; ".join(parts))


def _ip_key(ip: str) -> tuple[int | str, ...]:
    parts = ip.split(".")
    return (0, *map(int, parts)) if len(parts) == 4 and all(p.isdigit() for p in parts) else (1, ip)
