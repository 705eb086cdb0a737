"""How the non-sync drivers move the actor's weights to the rollout workers (`trainer.weight_sync.transport`).

`call`: actor rank 0 returns the flat buckets to the driver, which passes them to every rollout rank's
`receive_weights` (Ray's object store between processes; a reference on the local backend).
`collective`: built once here (actor rank 0 hosts a store and starts its sender, every rollout rank joins); per
update actor rank 0 queues the buckets on its sender and the driver passes only their control message (sequence
number and layout); the tensors are broadcast over the weight group (workers/weight_collective.py).
`auto` is `collective` when both the actor and the rollout workers are Ray actors, `call` otherwise.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hybridflow.workers.weight_collective import BroadcastStats

if TYPE_CHECKING:
    from hybridflow.config import Config
    from hybridflow.workers.actor_rollout_ref import ActorRolloutRefGroup
    from hybridflow.workers.rollout_worker import RolloutGroup, Weights

logger = logging.getLogger(__name__)


@dataclass
class Staged:
    """One update's weights, ready for `receive_weights`: what to pass, its size, and the trainer-side metrics of
    broadcasts finished since the previous update (collective only)."""

    weights: Weights
    nbytes: int
    buckets: int
    metrics: dict[str, float]


class CallTransport:
    name = "call"

    def __init__(self, actor: ActorRolloutRefGroup, bucket_bytes: int) -> None:
        self.actor, self.bucket_bytes = actor, bucket_bytes

    def stage(self) -> Staged:
        buckets = self.actor.weight_buckets(self.bucket_bytes)[0]
        return Staged(buckets, sum(b.nbytes for b in buckets), len(buckets), {"weight_sync/collective": 0.0})


class CollectiveTransport:
    name = "collective"

    def __init__(self, actor: ActorRolloutRefGroup, rollout: RolloutGroup, bucket_bytes: int,
                 timeout_s: float) -> None:
        self.actor, self.bucket_bytes = actor, bucket_bytes
        n = rollout.worker_group.world_size
        address = actor.open_weight_sender(n, timeout_s)[0]
        self.backend = rollout.join_weight_group(address, n + 1, timeout_s)[0]
        logger.info("weight sync: %s broadcast from actor rank 0 to %d rollout worker(s) over %s:%d",
                    self.backend, n, *address)

    def stage(self) -> Staged:
        msg, finished = self.actor.stage_weights(self.bucket_bytes)[0]
        return Staged(msg, msg.nbytes, len(msg.specs), {"weight_sync/collective": 1.0, **_sender_metrics(finished)})


def _sender_metrics(finished: list[BroadcastStats]) -> dict[str, float]:
    if not finished:
        return {}
    return {"weight_sync/broadcast_s": sum(s.broadcast_s for s in finished),
            "weight_sync/broadcast_wait_s": sum(s.wait_s for s in finished),
            "weight_sync/broadcasts_done": float(len(finished))}


WeightTransport = CallTransport | CollectiveTransport


def build_weight_transport(cfg: Config, actor: ActorRolloutRefGroup, rollout: RolloutGroup) -> WeightTransport:
    ws = cfg.trainer.weight_sync
    bucket_bytes = int(ws.bucket_mb * 2**20)
    kinds = {actor.worker_group.backend_kind, rollout.worker_group.backend_kind}
    transport = ws.transport if ws.transport != "auto" else ("collective" if kinds == {"ray"} else "call")
    if transport == "call":
        return CallTransport(actor, bucket_bytes)
    if kinds != {"ray"}:
        raise ValueError(f"trainer.weight_sync.transport=collective needs the actor and the rollout workers on Ray "
                         f"(their own processes), but they run on the {' and '.join(sorted(kinds))} backend "
                         "(trainer.backend=auto picks local for one process); set trainer.backend=ray or "
                         "trainer.weight_sync.transport=call")
    return CollectiveTransport(actor, rollout, bucket_bytes, ws.timeout_s)
