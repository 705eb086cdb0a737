"""Decode-step micro-benchmark: the engine's decode composition against the ones it replaced,
all with the engine's GPU ops (torch.compile'd pieces, Triton attention / KV store / sampler).

Run on one GPU from the repo root:  python3 -m benchmarks.decode_fusion [--out $OUT/decode_fusion.json]
CPU smoke (nothing measured, just that it runs):  python3 -m benchmarks.decode_fusion --smoke

Cases: `engine` (the default `DecodeOps`: fused norms — `mlp_block_norm` returns the next layer's normed input —
RoPE inside the K/V-store and attention kernels, `residual_add`, pieces compiled with shapes specialised first);
`unfused` (`qkv` + `mlp_block`, RoPE in torch); `fused_norms` (RoPE in torch); `plain_add` (residual adds as
`x + linear`, which Inductor folds into cuBLAS addmm with a copy of x); `unfused+plain_add`; and on CUDA
`all_dynamic` (every dimension symbolic in the compile) and `unfused+plain_add+all_dynamic` (the composition before
session 12). One decode step = `forward.decode` (logits) on `--rows` rows whose K/V caches hold `--context`
columns, a preset's shape (Qwen2.5-0.5B by default) with random weights, bf16. On CUDA each case is captured in a
CUDA graph (as the engine does) and replayed `--reps` times: `step_ms` per step. `kernels_per_step` counts the GPU
kernels of one replay through torch.profiler (on CPU: the aten ops of one eager step), `top_kernels` lists the
most frequent names, `kernel_time_us` the names taking the most GPU time in one replay (name, count, µs, share)
(`kernels_per_eager_step`: the same count for one step outside the graph). Against the first case: the logits'
largest difference and argmax agreement, and which fraction of the K values written this step differ (0 on CPU
eager: the same ops in the same order). Prints one JSON line (and writes it to --out).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import platform
import time

import torch
from transformers import AutoModelForCausalLM

from benchmarks.harness import emit_json_line
from hybridflow.models.presets import preset_config
from hybridflow.rollout import forward
from hybridflow.rollout.kv_cache import KVCache
from hybridflow.rollout.weights import WeightView, arch_spec
from hybridflow.utils.compile import GuardedCompile


def build(args, dev: torch.device, dtype: torch.dtype):
    overrides = dict(num_hidden_layers=args.layers) if args.layers else {}
    cfg = preset_config(args.preset, **overrides)
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype).eval()
    spec = arch_spec(model)
    weights = WeightView(model, dtype, dev).build()
    T = args.context + 64
    cache = KVCache(spec, args.rows, T, dtype, dev)
    rope = forward.RopeTable(model, T, dtype, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    for t in cache.k + cache.v:
        t.normal_(generator=g)
    b, L = args.rows, args.context
    state = dict(tok=torch.randint(3, spec.vocab, (b,), device=dev, generator=g),
                 start=torch.randint(0, L // 4 + 1, (b,), device=dev, generator=g))
    state["cidx"] = torch.full((b,), L - 1, device=dev, dtype=torch.long)
    state["pos"] = state["cidx"] - state["start"]
    cols = torch.arange(T, device=dev)
    state["valid"] = (cols[None] >= state["start"][:, None]) & (cols[None] < L - 1)
    return model, spec, weights, cache, rope, state


def mlp_block_plain_add(x, attn, lw, eps):
    """`forward.mlp_block` as it was before `residual_add`: `x + linear(...)`, which Inductor folds into addmm."""
    x = x + torch.nn.functional.linear(attn, lw.o, lw.o_bias)
    xn = forward.rms_norm(x, lw.ln2, eps)
    if lw.gate_up is not None:
        gate, up = torch.nn.functional.linear(xn, lw.gate_up).chunk(2, dim=-1)
    else:
        gate, up = torch.nn.functional.linear(xn, lw.gate), torch.nn.functional.linear(xn, lw.up)
    return x + torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, lw.down)


def mlp_block_norm_plain_add(x, attn, lw, next_norm, eps):
    x = mlp_block_plain_add(x, attn, lw, eps)
    return x, forward.rms_norm(x, next_norm, eps)


def step_fn(spec, weights, cache, rope, state, ops, L: int):
    def step():
        return forward.decode(weights, spec, rope, ops, state["tok"], state["pos"], state["cidx"], state["valid"],
                              state["start"], cache, L)
    return step


def count_kernels(run, cuda: bool) -> tuple[int, list, list]:
    """(kernels in one call of `run`, the 12 most frequent names with counts, the 16 names taking the most GPU
    time with [name, count, total µs, share of the kernels' summed time]; on CPU aten ops and no times)."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    names, us = collections.Counter(), collections.Counter()
    for e in prof.events():
        if cuda and e.device_type == torch.autograd.DeviceType.CUDA:
            names[e.name] += 1
            us[e.name] += e.time_range.elapsed_us()
        elif not cuda and e.name.startswith("aten::") and e.cpu_parent is None:
            names[e.name] += 1
    total = sum(us.values()) or 1.0
    by_time = [[n[:90], names[n], round(t, 1), round(t / total, 3)] for n, t in us.most_common(16)]
    return sum(names.values()), [[n[:90], c] for n, c in names.most_common(12)], by_time


def measure(name: str, ops, args, parts, dev: torch.device) -> tuple[dict, torch.Tensor]:
    spec, weights, cache, rope, state = parts
    step = step_fn(spec, weights, cache, rope, state, ops, args.context)
    cuda = dev.type == "cuda"
    t_compile = time.perf_counter()
    if cuda:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # torch.compile and Triton compile here, not in the capture
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step()
        graph.replay()
        torch.cuda.synchronize()
        t_compile = time.perf_counter() - t_compile
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(args.reps):
            graph.replay()
        t1.record()
        torch.cuda.synchronize()
        ms = t0.elapsed_time(t1) / args.reps
        kernels, top, by_time = count_kernels(graph.replay, cuda=True)
        eager_kernels, _, _ = count_kernels(step, cuda=True)  # a cross-check should a profiler not see graph kernels
        out = logits.float().clone()
    else:
        with torch.no_grad():
            out = step().float()
            t_compile = time.perf_counter() - t_compile
            t0 = time.perf_counter()
            for _ in range(args.reps):
                step()
            ms = (time.perf_counter() - t0) * 1e3 / args.reps
            kernels, top, by_time = count_kernels(step, cuda=False)
            eager_kernels = kernels
    row = dict(composition=name, step_ms=ms, kernels_per_step=kernels, kernels_per_layer=kernels / spec.num_layers,
               kernels_per_eager_step=eager_kernels,
               warmup_s=t_compile, top_kernels=top, kernel_time_us=by_time,
               compiled_ok={n: getattr(getattr(ops, n), "ok", None) for n in
                            ("qkv", "mlp_block", "qkv_normed", "mlp_block_norm", "embed_norm")})
    return row, out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=0, help="override the preset's layer count (0: keep it)")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--context", type=int, default=384, help="cache columns each step attends over (kv_len)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-compile", action="store_true", help="eager torch pieces (the compile fallback)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, 4 rows, 16 columns, eager")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.smoke:
        args.preset, args.rows, args.context, args.reps, args.no_compile = "tiny", 4, 16, 2, True
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, *parts = build(args, dev, dtype)
    ops = forward.DecodeOps.for_device(dev, compile_ops=not args.no_compile)
    res = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
               torch=torch.__version__, preset=args.preset, layers=parts[0].num_layers, rows=args.rows,
               context=args.context, dtype=str(dtype), compiled=ops.is_compiled, cuda_graphs=dev.type == "cuda",
               attention=getattr(ops.attention, "__name__", "sdpa"), kv_store=getattr(ops.kv_store, "__name__", None))
    rows, logits = [], []
    with torch.inference_mode():
        def wrap(fn, dynamic=None):
            return GuardedCompile(fn, fn.__name__, dynamic=dynamic) if ops.is_compiled else fn

        plain = dict(mlp_block=wrap(mlp_block_plain_add), mlp_block_norm=wrap(mlp_block_norm_plain_add))
        cases = [("engine", {}),  # the engine's default composition
                 ("unfused", dict(fuse_norms=False, rope_in_kernels=False)),
                 ("fused_norms", dict(rope_in_kernels=False)),
                 ("plain_add", plain),
                 ("unfused+plain_add", dict(fuse_norms=False, rope_in_kernels=False, **plain))]
        if ops.is_compiled:  # every dimension symbolic, as all compiled pieces were before
            cases.append(("all_dynamic", {n: wrap(getattr(forward, n), dynamic=True) for n in
                                          ("qkv", "mlp_block", "qkv_normed", "mlp_block_norm", "embed_norm",
                                           "qkv_project")}))
            cases.append(("unfused+plain_add+all_dynamic", dict(
                fuse_norms=False, rope_in_kernels=False, qkv=wrap(forward.qkv, dynamic=True),
                mlp_block=wrap(mlp_block_plain_add, dynamic=True))))
        cache = parts[2]
        b, col = args.rows, args.context - 1
        new_k = []
        for name, kw in cases:
            row, out = measure(name, dataclasses.replace(ops, **kw), args, parts, dev)
            rows.append(row)
            logits.append(out)
            new_k.append(torch.stack([c[torch.arange(b, device=dev), :, col] for c in cache.k]).float())
        for row, k in zip(rows[1:], new_k[1:]):
            row["k_written_mismatch_frac_vs_engine"] = (k != new_k[0]).float().mean().item()
            row["k_written_max_abs_diff_vs_engine"] = (k - new_k[0]).abs().max().item()
    res["results"] = rows
    for row, out in zip(rows[1:], logits[1:]):  # against the first case, the engine's composition
        row["max_abs_logit_diff_vs_engine"] = (out - logits[0]).abs().max().item()
        row["argmax_agree_vs_engine"] = (out.argmax(-1) == logits[0].argmax(-1)).float().mean().item()
        row["speedup_vs_engine"] = rows[0]["step_ms"] / row["step_ms"]
        row["kernels_saved_per_step"] = rows[0]["kernels_per_step"] - row["kernels_per_step"]
    res["max_abs_logit_diff"] = max(r["max_abs_logit_diff_vs_engine"] for r in rows[1:])
    res["argmax_agree"] = min(r["argmax_agree_vs_engine"] for r in rows[1:])
    emit_json_line(res, args.out)
    return res


if __name__ == "__main__":
    main()
