"""Write the own-task example's data: sort three digits ("sort 3 1 2 =" → "1 2 3"), verl-schema parquet with a
`response` column for the SFT warm start. 900 training rows, 100 validation rows.

    python examples/own_task/make_data.py OUT_DIR
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def row(rng: random.Random, i: int) -> dict:
    digits = [rng.randint(0, 9) for _ in range(3)]
    answer = " ".join(map(str, sorted(digits)))
    return {"data_source": "me/sort3", "prompt": [{"role": "user", "content": f"sort {' '.join(map(str, digits))} ="}],
            "ability": "toy", "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": {"index": i},
            "response": answer}


def main(out: Path) -> None:
    rng = random.Random(0)
    rows = [row(rng, i) for i in range(1000)]
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows[:900]), out / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[900:]), out / "val.parquet")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "."))
