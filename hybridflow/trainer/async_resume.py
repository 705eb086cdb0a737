"""The non-sync drivers' pipeline as a checkpoint payload, so a resumed run trains the samples an uninterrupted one
would: the rollouts generated ahead (finished, with their rows' versions, rollout metrics and prompts), prompts split
into requests but not yet submitted, and the loader batches they came from.

Decision: at a save the driver waits for its requests in flight rather than dropping them — one_step_off's next
batch was generated with weights that no longer exist after the step, so it cannot be regenerated, only kept. The
checkpoint's `"data"` stays the position after the last batch *trained*: a reader without this payload (sync mode,
or a payload that cannot be used) generates those prompts again, and a driver with it skips the loader batches the
payload holds (checking their uids). Tensors go to safetensors, everything else to JSON: loading runs no code.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from hybridflow.data.dataloader import DataPosition
from hybridflow.protocol import DataProto, keys

logger = logging.getLogger(__name__)

FORMAT = 1


@dataclass
class SavedRequest:
    """A finished generate call: its rows (reward-ready, ReMax baseline included), the rollout's metrics and what
    the driver knew when it submitted it."""

    rows: DataProto
    metrics: dict[str, float]
    prompts: DataProto
    version: int
    planned_step: int
    source: int | None


@dataclass
class Pipeline:
    """Everything between the loader and the trainer at a step boundary."""

    mode: str
    requests: list[SavedRequest]  # in the order the trainer takes them
    pending: list[tuple[DataProto, int, int | None]] = field(default_factory=list)  # async: (prompts, step, source)
    sources: dict[int, tuple[DataPosition, int]] = field(default_factory=dict)  # index → (position after, chunks left)
    next_source: int = 0
    trained_source: int = -1
    trained_position: DataPosition | None = None
    counters: dict[str, int] = field(default_factory=dict)  # async: outstanding, planned, exhausted, aborted

    def source_uids(self) -> dict[int, set[str]]:
        """Per loader batch, the uids of its prompts that the payload holds (to check the batches it skips)."""
        out: dict[int, set[str]] = {}
        parts = [(r.prompts, r.source) for r in self.requests] + [(p, s) for p, _, s in self.pending]
        for prompts, source in parts:
            if source is not None and keys.UID in prompts.non_tensor_batch:
                out.setdefault(source, set()).update(map(str, prompts.non_tensor_batch[keys.UID]))
        return out


def to_payload(p: Pipeline) -> dict[str, Any]:
    """`p` as a checkpoint payload (nested tensors and JSON). Raises ValueError for a column JSON cannot hold."""
    return {
        "format": FORMAT, "mode": p.mode,
        "requests": [{"rows": r.rows.to_state(), "metrics": dict(r.metrics), "prompts": r.prompts.to_state(),
                      "version": r.version, "planned_step": r.planned_step, "source": r.source}
                     for r in p.requests],
        "pending": [{"prompts": prompts.to_state(), "planned_step": step, "source": source}
                    for prompts, step, source in p.pending],
        "sources": [[i, pos.epoch, pos.batch, left] for i, (pos, left) in sorted(p.sources.items())],
        "next_source": p.next_source, "trained_source": p.trained_source,
        "trained_position": None if p.trained_position is None else p.trained_position.to_dict(),
        "counters": dict(p.counters),
    }


def from_payload(payload: dict[str, Any], mode: str) -> Pipeline | None:
    """The pipeline saved by `to_payload`, or None (with a warning: its prompts are generated again) when it was
    saved by another `trainer.mode` or a newer format."""
    if payload.get("format") != FORMAT or payload.get("mode") != mode:
        logger.warning("the checkpoint's rollouts generated ahead (format %s, trainer.mode=%s) cannot continue in "
                       "trainer.mode=%s: their prompts are generated again", payload.get("format"),
                       payload.get("mode"), mode)
        return None
    pos = payload["trained_position"]
    return Pipeline(
        mode=mode,
        requests=[SavedRequest(DataProto.from_state(r["rows"]), {k: float(v) for k, v in r["metrics"].items()},
                               DataProto.from_state(r["prompts"]), int(r["version"]), int(r["planned_step"]),
                               None if r["source"] is None else int(r["source"]))
                  for r in payload["requests"]],
        pending=[(DataProto.from_state(q["prompts"]), int(q["planned_step"]),
                  None if q["source"] is None else int(q["source"])) for q in payload["pending"]],
        sources={int(i): (DataPosition(int(e), int(b)), int(left)) for i, e, b, left in payload["sources"]},
        next_source=int(payload["next_source"]), trained_source=int(payload["trained_source"]),
        trained_position=None if pos is None else DataPosition(int(pos["epoch"]), int(pos["batch"])),
        counters={k: int(v) for k, v in payload["counters"].items()},
    )
