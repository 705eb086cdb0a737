"""Decode projections at few rows: cuBLAS (`F.linear`) against a Triton GEMM with split-K.

At 256 rows a decode projection of the 0.5B/1.5B shapes is a sub-microsecond job by bytes and by FLOPs, but cuBLAS's
tiles give it a few dozen CTAs and a serial walk over K, so each call costs several microseconds. This measures, per
projection shape and row count, the time of one call inside a CUDA graph that runs it over `--layers` distinct
weights (as the layers of a decode step do: no weight stays in L2 between calls), for cuBLAS and for each Triton
configuration of `CONFIGS` (tile sizes, warps, stages, split-K; split-K > 1 writes fp32 partials and adds a reduce
kernel, both in the timing). Checks every Triton result against cuBLAS (max abs difference, fp32 reference).

Run on one GPU:  python3 -m benchmarks.decode_gemm [--out $OUT/decode_gemm.json]
CPU smoke (Triton interpreter, one tiny shape, nothing timed):  TRITON_INTERPRET=1 python3 -m benchmarks.decode_gemm --smoke
Prints one JSON line: per (preset, projection, rows) cuBLAS µs, the best Triton config and its µs, the speed-up.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.harness import emit_json_line
from hybridflow.models.presets import preset_config
from hybridflow.utils.triton_util import jit, tl, triton

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K)
CONFIGS = [
    (64, 64, 64, 4, 4, 1), (64, 64, 128, 4, 3, 1), (128, 64, 64, 4, 4, 1), (128, 64, 64, 8, 4, 1),
    (64, 128, 64, 4, 4, 1), (128, 128, 64, 8, 3, 1), (64, 32, 128, 4, 4, 1), (32, 64, 128, 4, 4, 1),
    (128, 32, 64, 4, 4, 1), (64, 64, 64, 4, 5, 1), (256, 64, 64, 8, 3, 1), (256, 32, 64, 8, 4, 1),
    (64, 64, 64, 4, 4, 2), (64, 64, 128, 4, 3, 2), (128, 64, 64, 4, 4, 2), (64, 32, 128, 4, 4, 2),
    (64, 64, 64, 4, 4, 4), (64, 64, 128, 4, 3, 4), (128, 64, 64, 4, 4, 4), (64, 32, 128, 4, 4, 4),
]


@jit
def _linear_kernel(X, W, Y, M, N, K, sxm, sxk, swn, swk, sys, sym, syn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """Y[s] = X[:, Ks] @ W[:, Ks]^T for the s-th of SPLIT_K slices of K (Y fp32 [SPLIT_K, M, N] when split,
    else the output itself)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k0 = pid_k * k_len
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, k_len, BLOCK_K):
        rk = k0 + kk + tl.arange(0, BLOCK_K)
        x = tl.load(X + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(W + rn[None, :] * swn + rk[:, None] * swk, mask=(rn[None, :] < N) & (rk[:, None] < K), other=0.0)
        acc += tl.dot(x, w.to(x.dtype))  # an fp8 W is upcast in registers (fp8_gemm.py's weight-only variant)
    out = Y + pid_k * sys + rm[:, None] * sym + rn[None, :] * syn
    tl.store(out, acc.to(Y.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def triton_linear(x: torch.Tensor, w: torch.Tensor, cfg: tuple, out: torch.Tensor | None = None,
                  part: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T with one CONFIGS entry; `part` an fp32 [SPLIT_K, M, N] workspace when SPLIT_K > 1."""
    bm, bn, bk, warps, stages, split = cfg
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype) if out is None else out
    dst = out if split == 1 else part
    sys = 0 if split == 1 else dst.stride(0)
    sym, syn = dst.stride(-2), dst.stride(-1)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), split)
    _linear_kernel[grid](x, w, dst, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), sys, sym, syn,
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps, num_stages=stages)
    if split > 1:
        torch.sum(part, dim=0, out=out) if out.dtype == torch.float32 else out.copy_(part.sum(0))
    return out


def shapes(preset: str) -> dict[str, tuple[int, int]]:
    """(N, K) of each decode projection of `preset` (fused qkv and gate_up, as the rollout engine holds them)."""
    c = preset_config(preset)
    hd = c.hidden_size // c.num_attention_heads
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd
    return {"qkv": (qkv, c.hidden_size), "o": (c.hidden_size, c.num_attention_heads * hd),
            "gate_up": (2 * c.intermediate_size, c.hidden_size), "down": (c.hidden_size, c.intermediate_size),
            "lm_head": (c.vocab_size, c.hidden_size)}


def time_graph(fn, reps: int) -> float:
    """µs of one `fn()` call replayed from a CUDA graph (fn itself loops over the layers' weights)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1e3 / reps


def bench_shape(name: str, N: int, K: int, M: int, layers: int, reps: int, dev: torch.device) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)
    n_w = 1 if name == "lm_head" else layers
    ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g) * K ** -0.5 for _ in range(n_w)]
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
    ref = F.linear(x.float(), ws[0].float())
    outs = [torch.empty(M, N, device=dev, dtype=torch.bfloat16) for _ in ws]
    cublas_us = time_graph(lambda: [torch.matmul(x, w.t(), out=o) for w, o in zip(ws, outs)], reps) / n_w
    cublas_err = (F.linear(x, ws[0]).float() - ref).abs().max().item()
    rows = []
    for cfg in CONFIGS:
        part = torch.empty(cfg[5], M, N, device=dev, dtype=torch.float32) if cfg[5] > 1 else None
        try:
            err = (triton_linear(x, ws[0], cfg, part=part).float() - ref).abs().max().item()
            us = time_graph(lambda cfg=cfg, part=part: [triton_linear(x, w, cfg, o, part) for w, o in zip(ws, outs)],
                            reps) / n_w
        except Exception as e:  # noqa: BLE001 — a config may not compile (shared memory); recorded, not hidden
            rows.append(dict(config=list(cfg), error=f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        rows.append(dict(config=list(cfg), us=round(us, 2), max_abs_err=err))
    ok = [r for r in rows if "us" in r]
    best = min(ok, key=lambda r: r["us"]) if ok else None
    byte_floor_us = (N * K * 2 + M * K * 2 + M * N * 2) / 4.8e12 * 1e6
    return dict(projection=name, rows=M, N=N, K=K, cublas_us=round(cublas_us, 2), cublas_max_abs_err=cublas_err,
                best_triton=best, speedup=round(cublas_us / best["us"], 3) if best else None,
                hbm_floor_us=round(byte_floor_us, 2), configs=rows)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--rows", default="256,64")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter: one small shape, correctness only")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.smoke:
        x = torch.randn(5, 40)
        w = torch.randn(24, 40)
        errs = []
        for cfg in [(16, 16, 16, 4, 1, 1), (16, 16, 16, 4, 1, 2)]:
            part = torch.empty(cfg[5], 5, 24) if cfg[5] > 1 else None
            errs.append((triton_linear(x, w, cfg, part=part) - x @ w.t()).abs().max().item())
        res = dict(smoke=True, max_abs_err=max(errs))
    else:
        dev = torch.device("cuda")
        t0 = time.perf_counter()
        res = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, triton=triton.__version__,
                   layers=args.layers, results=[])
        for preset in args.presets.split(","):
            for name, (N, K) in shapes(preset).items():
                for M in (int(m) for m in args.rows.split(",")):
                    r = bench_shape(name, N, K, M, args.layers, args.reps, dev)
                    r["preset"] = preset
                    res["results"].append(r)
                    b = r["best_triton"] or {}
                    print(f"{preset} {name} M={M} N={N} K={K}: cublas {r['cublas_us']} us, triton {b.get('us')} us "
                          f"{b.get('config')} ({r['speedup']}x), floor {r['hbm_floor_us']} us", flush=True)
        res["wall_s"] = round(time.perf_counter() - t0, 1)
    emit_json_line(res, args.out)
    return res


if __name__ == "__main__":
    main()
