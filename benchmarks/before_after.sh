#!/usr/bin/env bash
# The tuned GRPO step (0.5B and 1.5B, `benchmarks.run --suite gpu --no-profile`) of an older tree and of this one in
# the same device call, one after the other, for a before/after table:
#   git archive <old-sha> | (mkdir -p .before && tar -x -C .before)     # here, before the call (untracked: it travels)
#   run(kind=nvidia-h200, command="BEFORE=.before bash benchmarks/before_after.sh", timeout_s=600)
# Prints both markdown tables; the JSON of each side lands under $OUT/before and $OUT/after.
set -u
OUT=$(realpath "${OUT:-bench_out}")
BEFORE=$(realpath "${BEFORE:?set BEFORE to the older tree}")
mkdir -p "$OUT/before" "$OUT/after"
export PYTHONUNBUFFERED=1
(cd "$BEFORE" && PYTHONPATH=$PWD timeout 270 python3 -m benchmarks.run --suite gpu --no-profile \
  --out "$OUT/before" >"$OUT/before.log" 2>&1; echo "before rc=$?" | tee -a "$OUT/before.log")
PYTHONPATH=$PWD timeout 270 python3 -m benchmarks.run --suite gpu --no-profile --out "$OUT/after" \
  >"$OUT/after.log" 2>&1
echo "after rc=$?" | tee -a "$OUT/after.log"
for side in before after; do echo "## $side"; cat "$OUT/$side/bench.md" 2>/dev/null || tail -20 "$OUT/$side.log"; done
