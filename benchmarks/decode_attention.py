"""Decode-attention micro-benchmark: Triton `decode_attention` vs the masked SDPA call of `forward.decode`.

Run on one GPU from the repo root:  python3 -m benchmarks.decode_attention [--sweep] [--out $OUT/attn.json]
Prints one JSON line (and writes it to --out if given).

Per case (b rows, Hkv kv heads, G query heads per kv head, D head dim, L = kv_len), bf16:
  sdpa:   F.scaled_dot_product_attention(q [b,Hkv,G,D], kc[:, :, :L], vc[:, :, :L], attn_mask=[b,1,1,L] additive)
          exactly as forward.decode; it reads all L columns of every row.
  triton: decode_attention(q, kc, vc, start, end) reading only each row's [start, end).
Rows are "ragged" (start uniform in [0, L/4], as left padding; end uniform in [L-8, L]) or "dense" (start 0,
end L). Timing: a CUDA graph of `--iters` calls cycling over enough distinct per-layer caches that they do not fit
in L2 (a decode step reads each layer's cache once), replayed `--reps` times; µs is per call. GB/s counts K+V
bytes of the columns each method reads (sdpa: b*L; triton: sum(end-start)); `useful_gbps` uses the triton bytes
for both, so it compares like with like. `max_abs_diff` is triton vs sdpa on the first cache (bf16 outputs).
"""

from __future__ import annotations

import argparse
import math
import platform

import torch
import torch.nn.functional as F

from benchmarks.harness import emit_json_line
from hybridflow.rollout.decode_attention import decode_attention

CASES = [  # (b, Hkv, G, D, L)
    (256, 2, 7, 64, 256), (256, 2, 7, 64, 384), (256, 2, 7, 64, 512),  # Qwen2.5-0.5B
    (256, 2, 6, 128, 256), (256, 2, 6, 128, 384), (256, 2, 6, 128, 512),  # Qwen2.5-1.5B
    (16, 2, 7, 64, 1024),  # few rows: exercises split-K
]
SWEEP = [  # (block_n, num_warps, num_stages)
    (32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 3),
]


def time_graph(fn, iters: int, reps: int) -> float:
    """µs per call of fn(i) for i in range(iters), captured once into a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (Triton compiles here) outside capture
        for i in range(min(iters, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        graph.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1e3 / (reps * iters)


def run_case(b: int, hkv: int, g: int, d: int, L: int, ragged: bool, args, dev: torch.device) -> dict:
    dtype = torch.bfloat16
    T = L + 128  # cache wider than kv_len, like the engine's per-layer cache (column slice for SDPA)
    el = torch.finfo(dtype).bits // 8
    layer_bytes = 2 * b * hkv * T * d * el
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 * 2**20)
    n_layers = max(2, min(32, math.ceil(4 * l2 / layer_bytes)))
    gen = torch.Generator(device=dev).manual_seed(0)
    ks = [torch.randn(b, hkv, T, d, device=dev, dtype=dtype, generator=gen) for _ in range(n_layers)]
    vs = [torch.randn(b, hkv, T, d, device=dev, dtype=dtype, generator=gen) for _ in range(n_layers)]
    q = torch.randn(b, hkv, g, d, device=dev, dtype=dtype, generator=gen)
    if ragged:
        start = torch.randint(0, L // 4 + 1, (b,), device=dev, generator=gen, dtype=torch.int32)
        end = L - torch.randint(0, 9, (b,), device=dev, generator=gen, dtype=torch.int32)
    else:
        start = torch.zeros(b, device=dev, dtype=torch.int32)
        end = torch.full((b,), L, device=dev, dtype=torch.int32)
    cols = torch.arange(L, device=dev)
    valid = (cols >= start[:, None]) & (cols < end[:, None])
    mask = torch.zeros(valid.shape, dtype=dtype, device=dev).masked_fill_(~valid, float("-inf"))[:, None, None, :]

    def sdpa(i):
        return F.scaled_dot_product_attention(q, ks[i % n_layers][:, :, :L], vs[i % n_layers][:, :, :L],
                                              attn_mask=mask)

    col_bytes = 2 * hkv * d * el  # K + V of one column of one row
    read_triton = int((end - start).clamp(min=0).sum()) * col_bytes
    read_sdpa = b * L * col_bytes
    us_sdpa = time_graph(sdpa, args.iters, args.reps)
    out = dict(b=b, hkv=hkv, g=g, d=d, L=L, ragged=ragged, n_layers=n_layers,
               mb_triton=read_triton / 1e6, mb_sdpa=read_sdpa / 1e6,
               sdpa_us=us_sdpa, sdpa_gbps=read_sdpa / us_sdpa / 1e3, sdpa_useful_gbps=read_triton / us_sdpa / 1e3)

    configs = SWEEP if args.sweep else [(64, 4, 2)]
    results = []
    for block_n, warps, stages in configs:
        def tri(i, block_n=block_n, warps=warps, stages=stages):
            return decode_attention(q, ks[i % n_layers], vs[i % n_layers], start, end, block_n=block_n,
                                    num_warps=warps, num_stages=stages)
        try:
            us = time_graph(tri, args.iters, args.reps)
        except Exception as e:  # a config that fails to compile (e.g. shared memory) is reported, not fatal
            results.append(dict(block_n=block_n, num_warps=warps, num_stages=stages, error=repr(e)[:200]))
            continue
        diff = (tri(0).float() - sdpa(0).float()).abs().max().item()
        results.append(dict(block_n=block_n, num_warps=warps, num_stages=stages, us=us,
                            gbps=read_triton / us / 1e3, max_abs_diff=diff))
    ok = [r for r in results if "us" in r]
    best = min(ok, key=lambda r: r["us"]) if ok else {}
    out.update(triton_us=best.get("us"), triton_gbps=best.get("gbps"), max_abs_diff=best.get("max_abs_diff"),
               best_config={k: best.get(k) for k in ("block_n", "num_warps", "num_stages")},
               speedup=(us_sdpa / best["us"]) if ok else None)
    if args.sweep:
        out["configs"] = results
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=64, help="calls per captured graph")
    p.add_argument("--reps", type=int, default=20, help="graph replays timed")
    p.add_argument("--sweep", action="store_true", help="also try block_n / num_warps / num_stages variants")
    p.add_argument("--dense", action="store_true", help="also run every case with start=0, end=L")
    p.add_argument("--out", default=None, help="also write the JSON line here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention benchmark needs a CUDA GPU")
    dev = torch.device("cuda")
    cases = []
    for case in CASES:
        for ragged in (True, False) if args.dense else (True,):
            cases.append(run_case(*case, ragged=ragged, args=args, dev=dev))
            torch.cuda.empty_cache()
    result = dict(bench="decode_attention", gpu=torch.cuda.get_device_name(dev), torch=torch.__version__,
                  triton=__import__("triton").__version__, python=platform.python_version(), cases=cases)
    emit_json_line(result, args.out)
    return result


if __name__ == "__main__":
    main()
