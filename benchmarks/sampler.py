"""Decode-sampler micro-benchmark: the fused Triton sampler's variants vs a plain read of the logits.

Run on one GPU from the repo root:  python3 -m benchmarks.sampler [--sweep] [--out $OUT/sampler.json]
Prints one JSON line (and writes it to --out if given).

Workload: the decode step of the GRPO anchor, N = 256 rows of bf16 logits over Qwen2's 151,936-entry vocab, mode
`sample` (Gumbel / exponential race) and `greedy`. Timing: a CUDA graph of `--iters` calls over distinct logits
buffers (so they do not sit in L2, as in decode where each step's logits are new), replayed `--reps` times; µs per
call. `floor` is `logits.amax(-1)` over the same buffers: one read of the logits and nothing else, the bandwidth floor
any sampler has to pay. Each variant's tokens are checked against the torch sampler (`sampling.sample`, same noise):
`token_mismatch` counts rows that differ (near-ties resolved differently by rounding can make it non-zero, rarely).

Variants: BLOCK (vocab entries per loop iteration), num_warps, programs per row. (The 2026-12-01 sweep also compared
the former per-lane-max Gumbel kernel, since removed; its numbers are in the git history of docs/benchmarks.md.)
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform

import torch

from benchmarks.decode_attention import time_graph
from hybridflow.rollout import sample_kernel as sk
from hybridflow.rollout.sampling import row_seed, sample


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--iters", type=int, default=16, help="calls per captured graph (distinct logits buffers)")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sweep", action="store_true", help="try BLOCK / num_warps / splits variants too")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    N, V = args.rows, args.vocab
    g = torch.Generator(device=dev).manual_seed(0)
    bufs = [(torch.randn(N, V, generator=g, device=dev) * 3).to(torch.bfloat16) for _ in range(args.iters)]
    seeds = torch.tensor([row_seed(0, i) for i in range(N)], device=dev)
    steps = torch.arange(N, device=dev) % 7
    t, k, tp = torch.tensor(0.7, device=dev), torch.tensor(V, device=dev), torch.tensor(1.0, device=dev)
    bytes_read = N * V * 2
    floor_us = time_graph(lambda i: bufs[i].amax(-1), args.iters, args.reps)
    res: dict = {"rows": N, "vocab": V, "gpu": torch.cuda.get_device_name(), "host": platform.node(),
                 "floor_amax_us": floor_us, "floor_gbps": bytes_read / floor_us / 1e3, "cases": []}
    ref = {mode: sample(bufs[0], mode, t, k, tp, seeds, steps)[0] for mode in ("sample", "greedy")}
    torch_us = time_graph(lambda i: sample(bufs[i], "sample", t, k, tp, seeds, steps), min(args.iters, 4), 5)
    res["torch_sample_us"] = torch_us
    grid = list(itertools.product(
        (1024, 2048, 4096) if args.sweep else (sk.BLOCK_V,), (4, 8, 16) if args.sweep else (sk.WARPS,),
        (None, 2 * sk.auto_splits(V)) if args.sweep else (None,)))
    for block, warps, splits in grid:
        for mode in ("sample", "greedy"):
            kw = dict(block=block, warps=warps, num_splits=splits)
            try:
                us = time_graph(lambda i: sk.fused_sample(bufs[i], mode, t, k, tp, seeds, steps, **kw),  # noqa: B023
                                 args.iters, args.reps)
                tok, _ = sk.fused_sample(bufs[0], mode, t, k, tp, seeds, steps, **kw)
                mismatch = int((tok != ref[mode]).sum())
            except Exception as err:  # a launch config that does not compile is a result of the sweep, not a crash
                res["cases"].append({"mode": mode, **kw, "error": f"{type(err).__name__}: {err}"[:200]})
                continue
            res["cases"].append({"mode": mode, **kw, "us": us, "gbps": bytes_read / us / 1e3,
                                 "x_floor": us / floor_us, "token_mismatch": mismatch})
            print(json.dumps(res["cases"][-1]), flush=True)
    best = {m: min((c for c in res["cases"] if c["mode"] == m and "us" in c), key=lambda c: c["us"])
            for m in ("sample", "greedy")}
    res["best"] = best
    line = json.dumps(res)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
