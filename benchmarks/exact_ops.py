"""Exact log-probs op by op: what each batch-invariant op (`engine/invariant.py`, Triton on CUDA) costs against the
op the default engines run, at the row counts that matter, and what that adds up to per layer and per forward.

GPU (one H200, a few minutes):  PYTHONPATH=. python3 -m benchmarks.exact_ops --out $OUT/exact_ops.json
CPU smoke (tiny shapes, the torch forms, wall clock):  PYTHONPATH=. python3 -m benchmarks.exact_ops --smoke
--out also gets a markdown table (same name, .md); the last line printed is a JSON summary of the totals.

Phases (bf16, the Qwen2.5-0.5B and 1.5B shapes of hybridflow's presets):
  decode64, decode256  one token per row; attention over 256 and 512 keys per row (the layer total: their mean)
  prefill              8 prompts x 256 tokens (2048); the LM head on each prompt's last token
  trainer              the packed forward of 32 sequences x 512 tokens (16384); the LM head on the 8192 response tokens
Ops, invariant against default:
  q k v o gate up down lm_head  invariant.linear vs F.linear (cuBLAS); q/k/v with Qwen2's biases
  qkv gate_up                   the exact rollout's fused GEMM (invariant.split_linear, one launch at the parts' tile
                                width; one GEMM per part where the kernels do not run) vs F.linear on the fused matrix
  rms_norm                      invariant.rms_norm vs eager torch (HF's math, forward.rms_norm); `compiled_us`: the
                                same under torch.compile (the default rollout fuses it with the residual add)
  attention@<keys>, attention   decode: invariant.attention vs `decode_attention` (the default decode's kernel);
                                prefill: invariant.attention over the prompts' cache vs causal SDPA (default
                                prefill); trainer: the packed attention function with and without its exact kwarg
                                (varlen flash)
  logprob                       invariant.token_logprobs vs the trainer's compiled `logit_stats` (log p and logZ)
Timing: µs per call from CUDA events around replays of a CUDA graph of >= 20 calls (GPU time: the engines' launch
overhead is not in it; the trainer's attention: 20 eager calls), median of --reps after a warm-up; a projection
cycles over enough weight copies to overflow the L2 cache, as a step reads each layer's weights once. Per layer:
2 norms + projections + attention (RoPE, SwiGLU and residual adds are not timed: the same elementwise work in both
modes, though only the default compiles and fuses it). default = the default engines' layer (the
rollout fused qkv/gate_up, the trainer separate), exact_fused = the exact rollout's, exact_separate = one GEMM per
part (the trainer's exact layer). Forward = layers x layer + head (lm_head + logprob; the exact trainer runs
token_logprobs on top of logit_stats, which its backward needs; the default rollout's log-prob comes out of its
sampling kernel, for which logit_stats stands in).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness import cell, environment, parse_choices, write_json, write_table
from hybridflow.engine import attention as packed
from hybridflow.engine import invariant, logprobs
from hybridflow.models.presets import preset_config
from hybridflow.rollout import forward
from hybridflow.rollout.decode_attention import decode_attention, decode_attention_ref
from hybridflow.utils.compile import GuardedCompile

FLUSH_BYTES = 128e6  # weight bytes a graph cycles through: more than the H200's 50 MB L2
CALLS = 20  # calls per graph replay (at least; more when a projection has more weight copies)
# decode: `rows` tokens, one per row, over each of `keys`; prefill / trainer: `seqs` sequences of `seq_len` tokens
PHASES = {"decode64": dict(rows=64, keys=(256, 512)), "decode256": dict(rows=256, keys=(256, 512)),
          "prefill": dict(seqs=8, seq_len=256), "trainer": dict(seqs=32, seq_len=512)}
SMOKE_PHASES = {"decode4": dict(rows=4, keys=(16, 32)), "prefill": dict(seqs=2, seq_len=16),
                "trainer": dict(seqs=4, seq_len=16)}
Fn = Callable[[int], object]  # weight copy index -> output
# the trainer's compiled log-prob statistics (engine/logprobs.py) and a compiled norm, one compile each
COMPILED_STATS = GuardedCompile(logprobs.logit_stats, "logit_stats")
COMPILED_NORM = GuardedCompile(forward.rms_norm, "rms_norm")


@dataclass
class Case:
    op: str
    rows: int
    exact: Fn
    default: Fn
    default_name: str | Callable[[], str]  # a callable is asked after the timing (a fallback may have happened)
    copies: int = 1
    graph: bool = True  # False: timed as eager calls, not a CUDA graph
    extra: dict[str, Fn] = field(default_factory=dict)


def _randn(*shape: int, dev: torch.device, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=dev) * scale).to(dtype)


def _shape(cfg) -> dict[str, int]:
    hd = cfg.hidden_size // cfg.num_attention_heads
    return dict(H=cfg.hidden_size, I=cfg.intermediate_size, V=cfg.vocab_size, heads=cfg.num_attention_heads,
                hkv=cfg.num_key_value_heads, hd=hd, eps=cfg.rms_norm_eps)


def _linear_case(op: str, sizes: tuple[int, ...], K: int, M: int, bias: bool, dev: torch.device,
                 dtype: torch.dtype, smoke: bool) -> Case:
    """One projection (several `sizes`: the fused matrix of those parts) at M rows over weight copies."""
    N = sum(sizes)
    copies = 1 if smoke else max(1, min(32, math.ceil(FLUSH_BYTES / (N * K * 2))))
    ws = [_randn(N, K, dev=dev, dtype=dtype, scale=K ** -0.5) for _ in range(copies)]
    bs = [_randn(N, dev=dev, dtype=dtype) if bias else None for _ in range(copies)]
    x = _randn(M, K, dev=dev, dtype=dtype)

    def exact(i: int) -> object:
        if len(sizes) == 1:
            return invariant.linear(x, ws[i], bs[i])
        if invariant.fusable(x, sizes):  # what exact_forward runs: one launch where it keeps the parts' bits
            return invariant.split_linear(x, ws[i], bs[i], sizes)
        parts_b = [None] * len(sizes) if bs[i] is None else bs[i].split(sizes)
        return [invariant.linear(x, w, b) for w, b in zip(ws[i].split(sizes), parts_b)]

    return Case(op, M, exact, lambda i: F.linear(x, ws[i], bs[i]), "F.linear", copies)


def projection_cases(s: dict[str, int], M: int, dev: torch.device, dtype: torch.dtype, smoke: bool) -> list[Case]:
    q, kv, H, inter = s["heads"] * s["hd"], s["hkv"] * s["hd"], s["H"], s["I"]
    shapes = {"q": ((q,), H, True), "k": ((kv,), H, True), "v": ((kv,), H, True), "qkv": ((q, kv, kv), H, True),
              "o": ((H,), q, False), "gate": ((inter,), H, False), "up": ((inter,), H, False),
              "gate_up": ((inter, inter), H, False), "down": ((H,), inter, False)}
    return [_linear_case(op, sizes, K, M, bias, dev, dtype, smoke) for op, (sizes, K, bias) in shapes.items()]


def norm_case(s: dict[str, int], M: int, dev: torch.device, dtype: torch.dtype) -> Case:
    x, w = _randn(M, s["H"], dev=dev, dtype=dtype), _randn(s["H"], dev=dev, dtype=dtype)
    case = Case("rms_norm", M, lambda i: invariant.rms_norm(x, w, s["eps"]),
                lambda i: forward.rms_norm(x, w, s["eps"]), "torch (forward.rms_norm)")
    if dev.type == "cuda":
        case.extra["compiled"] = lambda i: COMPILED_NORM(x, w, s["eps"])
    return case


def decode_attention_case(s: dict[str, int], b: int, keys: int, dev: torch.device, dtype: torch.dtype) -> Case:
    """b rows, one query each, over keys [0, keys) of its cache row (the decode step's attention)."""
    heads, hkv, hd = s["heads"], s["hkv"], s["hd"]
    T = -(-keys // 16) * 16
    kc, vc = (_randn(b, hkv, T, hd, dev=dev, dtype=dtype) for _ in range(2))
    q = _randn(b, heads, hd, dev=dev, dtype=dtype)
    rows, first = torch.arange(b, device=dev), torch.zeros(b, dtype=torch.long, device=dev)
    last, scale, blocks = torch.full((b,), keys - 1, device=dev), hd ** -0.5, -(-keys // invariant.KEY_BLOCK)
    qg, end = q.view(b, hkv, heads // hkv, hd), last + 1
    plain = decode_attention if dev.type == "cuda" else decode_attention_ref
    return Case(f"attention@{keys}", b, lambda i: invariant.attention(q, kc, vc, rows, first, last, blocks, scale),
                lambda i: plain(qg, kc, vc, first, end, scale), plain.__name__)


def prefill_attention_case(s: dict[str, int], B: int, P: int, dev: torch.device, dtype: torch.dtype) -> Case:
    """B full prompts of P tokens: the exact prefill's flat queries over the cache vs the default's causal SDPA."""
    heads, hkv, hd = s["heads"], s["hkv"], s["hd"]
    q = _randn(B * P, heads, hd, dev=dev, dtype=dtype)
    k, v = (_randn(B, P, hkv, hd, dev=dev, dtype=dtype).transpose(1, 2) for _ in range(2))  # as projected
    kc, vc = k.contiguous(), v.contiguous()  # the exact prefill attends over its KV cache
    rows = torch.arange(B, device=dev).repeat_interleave(P)
    pos = torch.arange(P, device=dev).repeat(B)
    first, scale = torch.zeros_like(pos), hd ** -0.5
    q4 = q.view(B, P, heads, hd).transpose(1, 2)
    gqa = dev.type == "cuda"  # forward.prefill: grouped K/V on CUDA, repeated elsewhere

    def sdpa(i: int) -> torch.Tensor:
        kg, vg = (k, v) if gqa else (k.repeat_interleave(heads // hkv, 1), v.repeat_interleave(heads // hkv, 1))
        return F.scaled_dot_product_attention(q4, kg, vg, is_causal=True, enable_gqa=gqa, scale=scale)

    return Case("attention", B * P, lambda i: invariant.attention(q, kc, vc, rows, first, pos, None, scale), sdpa,
                "causal SDPA")


def packed_attention_case(s: dict[str, int], B: int, L: int, dev: torch.device, dtype: torch.dtype) -> Case:
    """The trainer's packed causal attention over B sequences of L tokens, through its attention function."""
    heads, hkv, hd, T = s["heads"], s["hkv"], s["hd"], B * L
    q = _randn(1, T, heads, hd, dev=dev, dtype=dtype).transpose(1, 2)  # HF's [1, H, T, D] views
    k, v = (_randn(1, T, hkv, hd, dev=dev, dtype=dtype).transpose(1, 2) for _ in range(2))
    pack = {packed.CU_SEQLENS: torch.arange(0, T + 1, L, device=dev, dtype=torch.int32), packed.MAX_SEQLEN: L}

    def run(exact: bool) -> torch.Tensor:
        return packed.packed_attention_forward(None, q, k, v, None, scaling=hd ** -0.5,
                                               **pack, **({invariant.EXACT_KWARG: True} if exact else {}))[0]

    # eager: milliseconds a call at these sizes, and the padded SDPA fallback reads the lengths on the host
    return Case("attention", T, lambda i: run(True), lambda i: run(False), lambda: packed.packed_backend(dev, dtype),
                graph=False)


def head_cases(s: dict[str, int], R: int, dev: torch.device, dtype: torch.dtype, smoke: bool) -> list[Case]:
    z = _randn(R, s["V"], dev=dev, dtype=dtype, scale=4.0)
    labels = torch.randint(0, s["V"], (R,), device=dev)
    temp = torch.tensor(1.0, device=dev)
    stats = COMPILED_STATS if dev.type == "cuda" else logprobs.logit_stats
    return [_linear_case("lm_head", (s["V"],), s["H"], R, False, dev, dtype, smoke),
            Case("logprob", R, lambda i: invariant.token_logprobs(z, labels, temp),
                 lambda i: stats(z, labels, 1.0, False), "logit_stats" + (" (compiled)" if dev.type == "cuda" else ""))]


def phase_cases(s: dict[str, int], name: str, phase: dict, dev: torch.device, dtype: torch.dtype,
                smoke: bool) -> list[Case]:
    if name.startswith("decode"):
        M, head_rows = phase["rows"], phase["rows"]
        attn = [decode_attention_case(s, M, keys, dev, dtype) for keys in phase["keys"]]
    elif name == "prefill":  # the head on each prompt's last token
        M, head_rows = phase["seqs"] * phase["seq_len"], phase["seqs"]
        attn = [prefill_attention_case(s, phase["seqs"], phase["seq_len"], dev, dtype)]
    else:  # trainer: the head on the response half of each sequence
        M, head_rows = phase["seqs"] * phase["seq_len"], phase["seqs"] * phase["seq_len"] // 2
        attn = [packed_attention_case(s, phase["seqs"], phase["seq_len"], dev, dtype)]
    return [norm_case(s, M, dev, dtype), *projection_cases(s, M, dev, dtype, smoke), *attn,
            *head_cases(s, head_rows, dev, dtype, smoke)]


def time_cuda(fn: Fn, copies: int, reps: int, graph: bool) -> float:
    """Median µs of one call: CUDA events around a graph replay (or an eager run) of max(CALLS, copies) calls."""
    calls = max(CALLS, copies)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up: Triton compiles, cuBLAS and torch.compile pick their kernels
        for i in range(min(calls, 2 * copies)):
            fn(i % copies)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = None
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                fn(i % copies)

    def run() -> None:
        if g is not None:
            g.replay()
        else:
            for i in range(calls):
                fn(i % copies)

    run()
    times = []
    for _ in range(reps):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        run()
        t1.record()
        t1.synchronize()
        times.append(t0.elapsed_time(t1) * 1e3 / calls)
    return statistics.median(times)


def time_cpu(fn: Fn, copies: int, reps: int) -> float:
    fn(0)
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        fn(r % copies)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def measure(case: Case, reps: int, cuda: bool) -> dict:
    """µs of the exact op, the default op and any extra variant; an op that fails is recorded with its error."""
    out = dict(op=case.op, rows=case.rows, copies=case.copies)
    with torch.no_grad():
        for key, fn in [("exact_us", case.exact), ("default_us", case.default),
                        *[(f"{k}_us", f) for k, f in case.extra.items()]]:
            try:
                us = time_cuda(fn, case.copies, reps, case.graph) if cuda else time_cpu(fn, case.copies, reps)
            except Exception as e:  # noqa: BLE001 — an op may not run on this GPU or shape; recorded, not hidden
                first = str(e).splitlines()[0][:160] if str(e) else ""
                out[key.replace("_us", "_error")] = f"{type(e).__name__}: {first}"
                continue
            out[key] = round(us, 2)
    out["default"] = case.default_name() if callable(case.default_name) else case.default_name
    if "exact_us" in out and "default_us" in out:
        out["ratio"] = round(out["exact_us"] / out["default_us"], 3)
    return out


def totals(rows: list[dict], layers: int, trainer: bool) -> dict:
    """Per-layer and per-forward µs of each mode from one phase's op rows (None where an op failed)."""
    by = {r["op"]: r for r in rows}

    def us(side: str, *ops: str) -> float | None:
        vals = [by.get(op, {}).get(f"{side}_us") for op in ops]
        return None if None in vals else sum(vals)

    attn_ops = [op for op in by if op.startswith("attention")]

    def attn(side: str) -> float | None:
        vals = [us(side, op) for op in attn_ops]
        return None if None in vals or not vals else sum(vals) / len(vals)

    def add(*terms: float | None) -> float | None:
        return None if None in terms else round(sum(terms), 2)

    sep = ("q", "k", "v", "o", "gate", "up", "down")
    fused = ("qkv", "o", "gate_up", "down")
    norms = {side: None if us(side, "rms_norm") is None else 2 * us(side, "rms_norm") for side in ("exact", "default")}
    layer = {"default": add(norms["default"], us("default", *(sep if trainer else fused)), attn("default")),
             "exact_separate": add(norms["exact"], us("exact", *sep), attn("exact"))}
    if not trainer:
        layer["exact_fused"] = add(norms["exact"], us("exact", *fused), attn("exact"))
    head = {"default": add(us("default", "lm_head", "logprob")),
            "exact": add(us("exact", "lm_head", "logprob"), us("default", "logprob") if trainer else 0.0)}
    exact_layer = layer["exact_separate" if trainer else "exact_fused"]
    fwd = {"default": add(None if layer["default"] is None else layers * layer["default"], head["default"]),
           "exact": add(None if exact_layer is None else layers * exact_layer, head["exact"])}
    ratio = None if None in fwd.values() else round(fwd["exact"] / fwd["default"], 3)
    return dict(layer_us=layer, head_us=head, forward_us=fwd, forward_ratio=ratio, layers=layers)


def markdown(res: dict) -> str:
    lines = [f"exact_ops — {res['date']}, {res['gpu']}, commit {res['commit']}, torch {res['torch']}", "",
             "| preset | phase | op | rows | exact µs | default µs | exact / default | default op |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in res["results"]:
        lines.append(f"| {r['preset']} | {r['phase']} | {r['op']} | {r['rows']} | {cell(r.get('exact_us'), '{:.1f}')}"
                     f" | {cell(r.get('default_us'), '{:.1f}')} | {cell(r.get('ratio'), '{:.2f}')} | {r['default']} |")
    lines += ["", "| preset | phase | layer default µs | layer exact (fused) µs | layer exact (separate) µs | "
              "forward default µs | forward exact µs | exact / default |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for t in res["totals"]:
        lay = t["layer_us"]
        lines.append(f"| {t['preset']} | {t['phase']} | {cell(lay['default'], '{:.1f}')} | "
                     f"{cell(lay.get('exact_fused'), '{:.1f}')} | {cell(lay['exact_separate'], '{:.1f}')} | "
                     f"{cell(t['forward_us']['default'], '{:.0f}')} | {cell(t['forward_us']['exact'], '{:.0f}')} | "
                     f"{cell(t['forward_ratio'], '{:.2f}')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"of {', '.join(PHASES)}")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--smoke", action="store_true", help="CPU: the tiny preset, small phases, wall-clock timing")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.smoke:
        dev, presets, phases, args.reps = torch.device("cpu"), ["tiny"], SMOKE_PHASES, 2
    else:
        dev, presets = torch.device("cuda"), args.presets.split(",")
        phases = {p: PHASES[p] for p in parse_choices(args.phases, PHASES, "--phases")}
    cuda, dtype = dev.type == "cuda", torch.bfloat16 if dev.type == "cuda" else torch.float32
    res = dict(environment(), smoke=args.smoke, dtype=str(dtype), results=[], totals=[])
    torch.manual_seed(0)
    for preset in presets:
        cfg = preset_config(preset)
        s = _shape(cfg)
        for name, phase in phases.items():
            rows = [dict(preset=preset, phase=name) | measure(c, args.reps, cuda)
                    for c in phase_cases(s, name, phase, dev, dtype, args.smoke)]
            res["results"] += rows
            res["totals"].append(dict(preset=preset, phase=name) | totals(rows, cfg.num_hidden_layers,
                                                                           trainer=name == "trainer"))
            if cuda:
                torch.cuda.empty_cache()
            if args.out:
                write_json(args.out, res)
    res["wall_s"] = round(time.perf_counter() - t0, 2)
    if args.out:
        write_json(args.out, res)
        write_table(Path(args.out).with_suffix(".md"), markdown(res), append=False)
    else:
        print(markdown(res))
    print(json.dumps(dict(smoke=args.smoke, wall_s=res["wall_s"],
                          forward_ratio={f"{t['preset']} {t['phase']}": t["forward_ratio"] for t in res["totals"]})))
    return res


if __name__ == "__main__":
    main()
