"""Late columns: tensor columns a worker call's loss needs that arrive after the call started (`engine/update.py`).

The driver hands the call a function that returns the batch with them (`trainer/stage_schedule.py`); the engine
takes only the columns the batch lacks, and checks that the rest did not change under it.
"""

from __future__ import annotations

from hybridflow.protocol.data_proto import DataProto
from hybridflow.protocol.indexing import values_equal


def new_columns(batch: DataProto, late: DataProto) -> DataProto:
    """`late`'s tensor columns that `batch` lacks. The rows must be the same, in the same order, and a column both
    hold must not have changed (what the update already read would be stale): checked, not assumed."""
    if len(late) != len(batch):
        raise ValueError(f"late columns have {len(late)} rows, the batch {len(batch)}")
    for key in sorted(set(late.batch) & set(batch.batch)):
        if not values_equal(late.batch[key], batch.batch[key]):
            raise ValueError(f"late columns: {key!r} differs from the batch the update started with; the late "
                             "function may only add columns (or set reward.overlap=false)")
    return late.select([k for k in late.batch if k not in batch.batch], [], [])
