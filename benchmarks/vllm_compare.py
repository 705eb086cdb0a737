"""The table of `benchmarks/vllm_round.sh`: our generate time beside vLLM's per shape, and the ratio.

vLLM: the median of three timed repeats (fresh prompts each); ours: the best of benchmarks/rollout.py's repeats
(its `generate_s`), with its prefill/decode split. Usage: python3 -m benchmarks.vllm_compare OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(out: Path) -> list[str]:
    lines = ["| shape | vLLM 0.26 generate | ours | ours: prefill / decode | ours vs vLLM |", "|---|---|---|---|---|"]
    for ours_file in sorted(out.glob("ours_*.json")):
        shape = ours_file.stem.removeprefix("ours_")
        ours = json.loads(ours_file.read_text())["results"]
        vllm_file = out / f"vllm_{shape}.json"
        vllm = json.loads(vllm_file.read_text()) if vllm_file.exists() and vllm_file.read_text().strip() else None
        if not ours:
            lines.append(f"| {shape} | — | failed (see ours.log) | — | — |")
            continue
        r = ours[0]
        tokens = r["batch"] * r["new_tokens"]
        ours_cell = f"{r['generate_s']:.3f} s ({tokens / r['generate_s'] / 1e3:.1f}k tok/s)"
        split = f"{r['prefill_s']:.2f} s / {r['decode_s']:.2f} s"
        if vllm is None:
            lines.append(f"| {shape} | failed (see vllm.log) | {ours_cell} | {split} | — |")
            continue
        v = vllm["gen_s"][len(vllm["gen_s"]) // 2]
        lines.append(f"| {shape} | {v:.3f} s ({vllm['tokens'] / v / 1e3:.1f}k tok/s) | {ours_cell} | {split} | "
                     f"{v / r['generate_s']:.2f}x |")
    return lines


def main() -> None:
    out = Path(sys.argv[1])
    table = "\n".join(rows(out))
    (out / "vllm_compare.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
