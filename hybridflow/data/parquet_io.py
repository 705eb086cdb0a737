"""Read and write verl-schema parquet files, locally or through any fsspec URL (s3://, hdfs://, gs://, ...).

Rows are plain Python dicts (`pyarrow.Table.to_pylist`): no pandas dependency, nested columns (chat messages,
`reward_model`, `extra_info`) come back as lists and dicts.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

logger = logging.getLogger(__name__)


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _expand(path: str) -> list[str]:
    """A directory stands for the sorted `*.parquet` files inside it."""
    local = path.removeprefix("file://")
    if not _is_url(path) and Path(local).is_dir():
        files = sorted(str(p) for p in Path(local).glob("*.parquet"))
        if not files:
            raise ValueError(f"data file {path!r} is a directory without *.parquet files; point to the files")
        return files
    return [local if not _is_url(path) else path]


def read_table(path: str) -> pa.Table:
    """One parquet file as a pyarrow Table (fsspec for URLs)."""
    if _is_url(path):
        import fsspec

        with fsspec.open(path, "rb") as f:
            return pq.read_table(f)
    if not Path(path).exists():
        raise ValueError(f"data file {path!r} does not exist; check data.train_files / data.val_files")
    return pq.read_table(path)


def read_rows(files: str | Sequence[str], sources: list[tuple[str, int]] | None = None) -> list[dict[str, Any]]:
    """All rows of `files` (in order) as dicts; columns missing from one file are None in its rows. `sources`, when
    given, gets (file, rows read from it) for each file, for `row_origin`."""
    paths = [p for f in ([files] if isinstance(files, str) else files) for p in _expand(str(f))]
    rows: list[dict[str, Any]] = []
    for path in paths:
        table = read_table(path)
        logger.info("read %d rows from %s", table.num_rows, path)
        rows.extend(table.to_pylist())
        if sources is not None:
            sources.append((path, table.num_rows))
    return rows


def row_origin(sources: Sequence[tuple[str, int]], index: int) -> str:
    """" (file F, its row k)" for row `index` of the rows `read_rows` read from `sources`; "" when not known."""
    start = 0
    for path, n in sources:
        if index < start + n:
            return f" (file {path}, its row {index - start})"
        start += n
    return ""


def write_rows(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Write dict rows as one parquet file (parent directories created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(list(rows)), str(out))
    return out
