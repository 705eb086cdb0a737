"""FP8 projections against bf16: which `torch._scaled_mm` recipe of `rollout/fp8.py` pays at decode's and prefill's rows.

Per projection of Qwen2.5 1.5B / 7B (fused q/k/v, o, fused gate/up, down) and row count M: µs of one call in a CUDA
graph that runs it over enough distinct weights that the fp8 copies overflow L2 (as a decode step's layers do),
median of --reps replays timed with CUDA events after warm-up. Variants (the table's short names):
  bf16      `F.linear` on bf16 weights
  rw.e      the previous engine path, eager: per-token quantization, row-wise `_scaled_mm` (CUTLASS), exact accumulation
  twf.e     `fp8_linear` with the default GEMM (tensorwise_fast), eager
  g:<gemm>  the GEMM alone on pre-quantized activations: rw / rwf row-wise, tw / twf tensor-wise (cuBLASLt, scalar
            scales), f = use_fast_accum
  <gemm>.c  `fp8_linear` per GEMM recipe under `torch.compile` (amax, scale and cast fused, as in the engine's
            compiled decode pieces; the tensor-wise recipes' scale epilogue is a kernel of its own here, fused with the
            next op in the engine)
  ts.c      per-tensor activation and weight scales, both inside cuBLAS (compiled amax over the whole activation)
  w8.at     (--weight-only) fp8 weights upcast inside an Inductor max-autotune Triton GEMM (prologue fusion);
            autotunes per shape: minutes
  g:w8tr    (--weight-only, M <= 1024) `decode_gemm.py`'s Triton GEMM loading the fp8 weight and upcasting it in
            registers, the best of `W8_CONFIGS`; the per-channel scale is left to the next op (not timed)
Also per variant: TFLOP/s, TB/s (weights at their width, activations and output in bf16) and the relative error
against the fp32 product of the bf16 weights.

Run on one GPU (~60-90 s):  PYTHONPATH=. python3 -m benchmarks.fp8_gemm --out $OUT/fp8_gemm.json
CPU smoke (bf16 and the emulated recipes, one tiny shape; no `_scaled_mm`):  python3 -m benchmarks.fp8_gemm --smoke
The last line is a short JSON summary (the best fp8 variant per case); --out gets every number.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.decode_gemm import shapes, triton_linear
from benchmarks.harness import environment, write_json
from hybridflow.rollout import fp8

logger = logging.getLogger(__name__)
FLUSH_BYTES = 128e6  # fp8 weight bytes a graph walks through per call: more than the H200's 50 MB L2
ABBR = {"rowwise": "rw", "rowwise_fast": "rwf", "tensorwise": "tw", "tensorwise_fast": "twf"}  # fp8.GEMMS
SHORT = {"bf16": "bf16", "rowwise.eager": "rw.e", "tensorwise_fast.eager": "twf.e", "tensor_scales.compiled": "ts.c",
         "weight_only.autotune": "w8.at", "gemm.w8_triton": "g:w8tr",
         **{f"gemm.{g}": f"g:{a}" for g, a in ABBR.items()},
         **{f"{g}.compiled": f"{a}.c" for g, a in ABBR.items()}, **{f"{g}.emulated": f"{a}.em" for g, a in ABBR.items()}}
Variant = Callable[[int], torch.Tensor]  # layer copy index -> output
# decode_gemm.CONFIGS entries (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, SPLIT_K) tried for the Triton weight-only GEMM
W8_CONFIGS = [(64, 64, 128, 4, 3, 1), (64, 128, 64, 4, 4, 1), (128, 64, 64, 4, 4, 1), (128, 128, 64, 8, 3, 1),
              (64, 64, 128, 4, 3, 2), (64, 32, 128, 4, 4, 4)]


def quantize_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, fp32 scalar scale): one scale for the whole tensor (the ts.c recipe)."""
    scale = x.float().abs().amax().clamp(min=1e-12) / fp8.FP8_MAX
    return (x.float() / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8), scale


def tensor_scales_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    xq, x_scale = quantize_tensor(x)
    return torch._scaled_mm(xq, w8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype, use_fast_accum=True)


def weight_only_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    return (F.linear(x, w8.to(x.dtype)).float() * w_scale).to(x.dtype)


@functools.cache
def compiled(name: str) -> Callable:
    """One compile per recipe, every dimension symbolic (no recompile per shape)."""
    if name == "tensor_scales":
        return torch.compile(tensor_scales_linear, dynamic=True)
    if name == "weight_only":
        return torch.compile(weight_only_linear, dynamic=False, mode="max-autotune-no-cudagraphs")
    return torch.compile(functools.partial(fp8.fp8_linear, gemm=name), dynamic=True)


def variants(M: int, N: int, K: int, copies: int, dev: torch.device, smoke: bool,
             weight_only: bool) -> tuple[dict[str, Variant], torch.Tensor, list[torch.Tensor]]:
    """The variants over `copies` distinct weights, x [M, K] bf16, and the bf16 weights."""
    g = torch.Generator(device=dev).manual_seed(0)
    ws = [(torch.randn(N, K, device=dev, generator=g) * K ** -0.5).bfloat16() for _ in range(copies)]
    x = torch.randn(M, K, device=dev, generator=g).bfloat16()
    per_row = [fp8.quantize_rows(w) for w in ws]
    w8 = [c for c, _ in per_row]
    wsc = [s.squeeze(-1) for _, s in per_row]
    out: dict[str, Variant] = {"bf16": lambda i: F.linear(x, ws[i])}
    if smoke:  # the CPU has no fast fp8 GEMM to time: the emulation of each recipe, for the numbers' plumbing
        for gemm in fp8.GEMMS:
            out[f"{gemm}.emulated"] = lambda i, gemm=gemm: fp8.fp8_linear(x, w8[i], wsc[i], emulate=True, gemm=gemm)
        return out, x, ws
    xq, xs = fp8.quantize_rows(x)
    one = fp8.unit_scale(x.device)  # cuda:0, the key fp8_linear looks up
    out["rowwise.eager"] = lambda i: fp8.fp8_linear(x, w8[i], wsc[i], gemm="rowwise")
    out["tensorwise_fast.eager"] = lambda i: fp8.fp8_linear(x, w8[i], wsc[i], gemm="tensorwise_fast")
    for fast in (False, True):
        sfx = "_fast" if fast else ""
        out[f"gemm.rowwise{sfx}"] = lambda i, f=fast: torch._scaled_mm(
            xq, w8[i].t(), scale_a=xs, scale_b=wsc[i][None], out_dtype=torch.bfloat16, use_fast_accum=f)
        out[f"gemm.tensorwise{sfx}"] = lambda i, f=fast: torch._scaled_mm(
            xq, w8[i].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=f)
    for gemm in ABBR:
        out[f"{gemm}.compiled"] = lambda i, gemm=gemm: compiled(gemm)(x, w8[i], wsc[i])
    per_tensor = [quantize_tensor(w) for w in ws]
    out["tensor_scales.compiled"] = lambda i: compiled("tensor_scales")(x, *per_tensor[i])
    if weight_only:
        out["weight_only.autotune"] = lambda i: compiled("weight_only")(x, w8[i], wsc[i][None])
        if M <= 1024:
            out["gemm.w8_triton"] = triton_weight_only(x, w8)
    return out, x, ws


def triton_weight_only(x: torch.Tensor, w8: list[torch.Tensor]) -> Variant:
    """The fastest `W8_CONFIGS` entry for x @ upcast(w8)^T (a short timing of each), as a variant; `.config` names it."""
    M, N = x.shape[0], w8[0].shape[0]
    parts = {c[5]: torch.empty(c[5], M, N, device=x.device) for c in W8_CONFIGS if c[5] > 1}
    best = None
    for cfg in W8_CONFIGS:
        fn = functools.partial(lambda i, cfg: triton_linear(x, w8[i], cfg, part=parts.get(cfg[5])), cfg=cfg)
        try:
            us = time_graph(fn, len(w8), reps=5)
        except Exception as e:  # noqa: BLE001 — a config may not compile (shared memory); the others still count
            logger.warning("weight-only Triton config %s: %s", cfg, e)
            continue
        if best is None or us < best[0]:
            best = (us, cfg, fn)
    if best is None:
        raise RuntimeError("no W8_CONFIGS entry ran")
    best[2].config = list(best[1])
    return best[2]


def time_graph(fn: Variant, copies: int, reps: int) -> float:
    """Median µs of one call, from `reps` replays of a CUDA graph calling fn over every weight copy."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: compiles, cuBLAS workspaces
        for _ in range(2):
            for i in range(copies):
                fn(i)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    times = []
    for _ in range(reps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        graph.replay()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) * 1e3 / copies)
    return statistics.median(times)


def time_cpu(fn: Variant, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(0)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def bench_case(preset: str, proj: str, N: int, K: int, M: int, args: argparse.Namespace,
               dev: torch.device) -> dict:
    copies = 1 if args.smoke else max(1, min(32, math.ceil(FLUSH_BYTES / (N * K))))
    fns, x, ws = variants(M, N, K, copies, dev, args.smoke, args.weight_only)
    ref = F.linear(x.float(), ws[0].float())
    rows = {}
    for name, fn in fns.items():
        try:
            got = fn(0)
            err = None if name.startswith("gemm.") else ((got.float() - ref).norm() / ref.norm()).item()
            us = time_cpu(fn, args.reps) if args.smoke else time_graph(fn, copies, args.reps)
        except Exception as e:  # noqa: BLE001 — a variant may not run on this GPU or shape; recorded, not hidden
            rows[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
            continue
        w_bytes = N * K * (2 if name == "bf16" else 1)
        rows[name] = dict(us=round(us, 2), tflops=round(2 * M * N * K / us / 1e6, 1),
                          tbps=round((w_bytes + 2 * M * K + 2 * M * N) / us / 1e6, 3), rel_err=err,
                          config=getattr(fn, "config", None))
    return dict(preset=preset, projection=proj, M=M, N=N, K=K, copies=copies, variants=rows)


def _case(r: dict) -> str:
    return f"{r['preset'].replace('qwen2.5-', '')} {r['projection']} {r['M']}"


def table(results: list[dict], cell: Callable[[dict, dict], str]) -> str:
    """One row per case, one column per variant (`SHORT` names); cell(case, variant's numbers)."""
    names = list(results[0]["variants"])
    lines = [f"{'case':<20}" + "".join(f"{SHORT.get(n, n[:7]):>8}" for n in names)]
    for r in results:
        cells = [cell(r, r["variants"][n]) if "us" in r["variants"].get(n, {}) else "-" for n in names]
        lines.append(f"{_case(r):<20}" + "".join(f"{c:>8}" for c in cells))
    return "\n".join(lines)


def summary(results: list[dict]) -> list[dict]:
    """Per case: bf16 µs, the fastest full fp8 variant (quantization included) and its speed-up."""
    out = []
    for r in results:
        full = {n: v["us"] for n, v in r["variants"].items() if "us" in v and n != "bf16" and not n.startswith("gemm.")}
        bf16 = r["variants"].get("bf16", {}).get("us")
        best = min(full, key=full.get) if full else None
        out.append(dict(case=_case(r), bf16_us=bf16, best=best,
                        best_us=full.get(best), speedup=round(bf16 / full[best], 3) if best and bf16 else None))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="qwen2.5-1.5b,qwen2.5-7b")
    ap.add_argument("--rows", default="64,256,1024,16384")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--weight-only", action="store_true", help="add w8.at (Inductor max-autotune per shape: slow)")
    ap.add_argument("--smoke", action="store_true", help="CPU: bf16 and the emulated recipes at one tiny shape")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.smoke:
        dev, cases = torch.device("cpu"), [("tiny", "qkv", 48, 64, 5)]
        args.reps = 3
    else:
        dev = torch.device("cuda")
        torch._dynamo.config.recompile_limit = 64  # one compile per recipe (w8.at: per shape)
        cases = [(p, proj, N, K, M) for p in args.presets.split(",") for proj, (N, K) in shapes(p).items()
                 if proj != "lm_head" for M in (int(m) for m in args.rows.split(","))]
    res = dict(environment(), results=[])
    for preset, proj, N, K, M in cases:
        res["results"].append(bench_case(preset, proj, N, K, M, args, dev))
        if args.out:
            write_json(args.out, res)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    rs = res["results"]
    print("µs per call (median)\n" + table(rs, lambda r, v: f"{v['us']:.1f}"))
    print("TB/s at M < 1024 (weights at their width, bf16 activations and output), TFLOP/s from 1024 rows\n"
          + table(rs, lambda r, v: f"{v['tbps']:.2f}" if r["M"] < 1024 else f"{v['tflops']:.0f}"))
    first_m = [r for r in rs if r["M"] == rs[0]["M"]]
    print("relative error against the fp32 product\n"
          + table(first_m, lambda r, v: "-" if v["rel_err"] is None else f"{v['rel_err']:.4f}"))
    res["summary"] = summary(rs)
    if args.out:
        write_json(args.out, res)
    best = {s["case"]: [SHORT.get(s["best"], s["best"]), s["speedup"]] for s in res["summary"]}
    print(json.dumps(dict(smoke=args.smoke, wall_s=res["wall_s"], best_fp8_vs_bf16=best)))
    return res


if __name__ == "__main__":
    main()
