"""Rollout throughput: our RolloutEngine vs HF `generate` (static cache), HBM roofline, hybrid-engine switch time.

Run on one GPU:  PYTHONPATH=. python3 benchmarks/rollout.py --out $OUT/rollout.json
Random-init Qwen2.5 shapes (no download), random prompts, sampling with ignore_eos so every row decodes the full
length. Roofline = decode rows / ((weight bytes + KV bytes read per step) / measured copy bandwidth); we report it
for the KV a perfect engine reads (mean context) and for the columns our engine attends (KV-length buckets).
CPU smoke test:  python3 benchmarks/rollout.py --device cpu --cases tiny:4 --prompt-len 16 --new-tokens 8 --out x.json
FP8 rollout against bf16:  --quantization none,fp8 (every case in both; each result has `mismatch`: the sampled tokens'
log-probs from a teacher-forced HF forward of the unquantized model vs the engine's, as `rollout_is/*` would see them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import time
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM

from hybridflow.config import load_config
from hybridflow.models.presets import preset_config
from hybridflow.protocol import DataProto
from hybridflow.rollout import RolloutEngine, forward, sampling
from hybridflow.rollout import engine as rollout_engine
from hybridflow.rollout.kv_cache import bytes_per_slot

log = logging.getLogger("bench.rollout")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def copy_bandwidth(dev: torch.device, gib: float = 4.0) -> float:
    """Bytes/s of a big device-to-device copy (read + write counted)."""
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(dev)
    t0, iters = time.perf_counter(), 20
    for _ in range(iters):
        b.copy_(a)
    sync(dev)
    bw = 2 * a.numel() * a.element_size() * iters / (time.perf_counter() - t0)
    del a, b
    return bw


def make_model(preset: str, dev: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(preset_config(preset), dtype=dtype)
    return model.eval()


def make_prompts(B: int, P: int, vocab: int, dev: torch.device) -> DataProto:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (B, P), generator=g)
    mask = torch.ones(B, P, dtype=torch.long)
    pos = torch.arange(P).expand(B, P).clone()
    return DataProto.from_single_dict({"input_ids": ids.to(dev), "attention_mask": mask.to(dev),
                                       "position_ids": pos.to(dev)})


def weight_bytes_read(model: torch.nn.Module, elem_size: int | None = None) -> int:
    """Bytes of weights one decode step reads: every matrix once; an untied embedding table is only gathered.
    `elem_size` = bytes per element of the generation copy (bf16 views of fp32 master weights)."""
    seen, total = set(), 0
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    for p in model.parameters():
        if p.data_ptr() in seen or (p is emb and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * (elem_size or p.element_size())
    return total


def timed(fn, dev: torch.device) -> tuple[Any, float]:
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t0


def bench_engine(model, preset: str, B: int, P: int, R: int, dev: torch.device, bw: float, args,
                 quantization: str = "none") -> dict[str, Any]:
    rcfg = dataclasses.replace(load_config([], []).rollout, n=1, do_sample=True, temperature=1.0, ignore_eos=True,
                               max_num_seqs=B, max_num_batched_tokens=args.prefill_tokens, free_cache_engine=False,
                               enforce_eager=args.eager, gpu_memory_utilization=0.6, quantization=quantization)
    cfg = model.config
    gen_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if args.fp32_master:
        model.float()  # training's master weights: generation reads bf16 copies (fused q/k/v and gate/up)
    engine = RolloutEngine(model, rcfg, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
                           max_prompt_length=P, max_response_length=R, dtype=gen_dtype,
                           compile_decode=False if args.no_compile else None)
    prompts = make_prompts(B, P, cfg.vocab_size, dev)
    _, t_first = timed(lambda: engine.generate(prompts), dev)  # allocates the cache, compiles, captures graphs
    runs = []
    for _ in range(args.repeats):
        out, t = timed(lambda: engine.generate(prompts), dev)
        runs.append(t)
    t_gen = min(runs)
    assert int(out.batch["response_mask"].sum()) == B * R, "ignore_eos run did not produce full-length rows"
    one = DataProto.from_single_dict(dict(prompts.batch), meta_info={"max_new_tokens": 1})
    _, t_prefill = timed(lambda: engine.generate(one), dev)  # prefill + first token
    t_decode = max(t_gen - t_prefill, 1e-9)
    kv_tok = bytes_per_slot(engine.spec, 1, engine.dtype)
    w_bytes = weight_bytes_read(model, torch.empty(0, dtype=gen_dtype).element_size())
    if quantization == "fp8":  # the decoder projections are read as 1-byte codes (their scales are negligible)
        w_bytes -= sum(t.numel() for lw in engine._weights.layers for t in (lw.qkv, lw.o, lw.gate_up, lw.down)) * (
            torch.empty(0, dtype=gen_dtype).element_size() - 1)
    runner = engine._runner
    read_cols, hs = 0, 1  # replay the scheduler's choice of attended columns L per chunk of decode steps
    while hs < R:
        todo = min(engine.check_every, R - hs)
        read_cols += todo * next(x for x in runner.kv_buckets if x >= P + hs + todo - 1)
        hs += todo
    ideal_step = w_bytes + B * kv_tok * (P + R / 2)
    engine_step = w_bytes + B * kv_tok * read_cols / (R - 1)
    decode_tps = B * (R - 1) / t_decode
    res = {
        "engine": "hybridflow", "preset": preset, "batch": B, "prompt_len": P, "new_tokens": R,
        "quantization": quantization,
        "compiled": bool(runner.ops.is_compiled), "cuda_graphs": runner.use_graphs,
        "compiled_ok": {n: getattr(getattr(runner.ops, n), "ok", False)
                        for n in ("qkv_normed", "mlp_block_norm", "embed_norm")}
        | {"sample": getattr(runner.sampler, "ok", False)},
        "fuse_norms": runner.ops.fuse_norms,
        "attention": getattr(runner.ops.attention, "__name__", "sdpa"),
        "sampler": f"{runner.sampler.__module__}.{getattr(runner.sampler, '__name__', 'compiled')}",
        "fp32_master": args.fp32_master,
        "fused_qkv": runner.weights.layers[0].qkv is not None,
        "graphs": sorted(runner.graphs), "check_every": engine.check_every,
        "first_call_s": t_first, "generate_s": t_gen, "tokens_per_s": B * R / t_gen,
        "prefill_s": t_prefill, "decode_s": t_decode, "decode_tokens_per_s": decode_tps,
        "decode_step_ms": 1e3 * t_decode / (R - 1),
        "roofline_tokens_per_s": B * bw / ideal_step, "roofline_pct": 100 * decode_tps / (B * bw / ideal_step),
        "engine_bytes_roofline_pct": 100 * decode_tps / (B * bw / engine_step),  # vs the KV columns we read
        "weight_bytes": w_bytes, "kv_bytes_per_token": kv_tok,
        "metrics": {k: v for k, v in out.meta_info.get("metrics", {}).items()},
    }
    if args.profile and dev.type == "cuda":
        res["top_kernels"] = profile_kernels(lambda: engine.generate(prompts))
        res["top_kernels_prefill"] = profile_kernels(lambda: engine.generate(one), top=40)
    engine.release_cache()
    if args.mismatch_rows:
        res["mismatch"] = logprob_mismatch(model, out, args.mismatch_rows)
    if args.fp32_master:
        model.to(gen_dtype)
    return res


@torch.no_grad()
def logprob_mismatch(model, out: DataProto, rows: int, chunk: int = 8) -> dict[str, float]:
    """The first `rows` rows' sampled tokens scored by a teacher-forced HF forward of `model` (what the trainer's
    old-log-prob pass computes, at temperature 1) against the engine's log-probs: ρ = exp(hf − engine) per token."""
    b, P = out.batch, out.batch["prompts"].shape[1]
    gaps = []
    for s in range(0, min(rows, len(out)), chunk):
        ids = b["input_ids"][s: s + chunk]
        logits = model(input_ids=ids, attention_mask=b["attention_mask"][s: s + chunk],
                       position_ids=b["position_ids"][s: s + chunk]).logits[:, P - 1:-1]
        hf = torch.log_softmax(logits.float(), -1).gather(-1, b["responses"][s: s + chunk, :, None]).squeeze(-1)
        mask = b["response_mask"][s: s + chunk].bool()
        gaps.append((hf - b["rollout_log_probs"][s: s + chunk].float())[mask])
    gap = torch.cat(gaps)
    ratio = gap.exp()
    return {"tokens": gap.numel(), "abs_logp_gap_mean": float(gap.abs().mean()), "abs_logp_gap_max": float(gap.abs().max()),
            "ratio_mean": float(ratio.mean()), "ratio_max": float(ratio.max()), "ratio_min": float(ratio.min()),
            "clip_frac_cap2": float((ratio > 2).float().mean())}


def profile_kernels(fn, top: int = 25) -> list[dict[str, Any]]:
    """Device time per kernel name over one call of fn (torch.profiler, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    every = sorted(prof.key_averages(), key=lambda a: a.device_time_total, reverse=True)
    total = {"name": "(all kernels)", "ms": sum(a.device_time_total for a in every) / 1e3,
             "calls": sum(a.count for a in every)}
    return [total] + [{"name": a.key[:200], "ms": a.device_time_total / 1e3, "calls": a.count} for a in every[:top]]


def bench_switch(model, dev: torch.device, P: int, R: int, fp32_master: bool) -> dict[str, Any]:
    """train→generate (sync_weights) and generate→train (release_cache) times; cache allocation apart."""
    rcfg = dataclasses.replace(load_config([], []).rollout, max_num_seqs=64, free_cache_engine=True)
    cfg = model.config
    gen_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    work = model.float() if fp32_master else model
    engine = RolloutEngine(work, rcfg, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
                           max_prompt_length=P, max_response_length=R, dtype=gen_dtype)
    to_gen, to_train, alloc = [], [], []
    prompts = make_prompts(8, P, cfg.vocab_size, dev)
    prompts.meta_info["max_new_tokens"] = 4
    for _ in range(4):
        with torch.no_grad():  # stand-in for an optimizer step: parameters change in place
            next(work.parameters()).add_(1e-3)
        _, t = timed(engine.sync_weights, dev)
        to_gen.append(t)
        engine.generate(prompts)  # free_cache_engine=True: releases the cache at the end
        alloc.append(engine.timing.get("timing/rollout_cache_alloc", float("nan")))
        _, t = timed(engine.release_cache, dev)
        to_train.append(t)
    if fp32_master:
        model.to(torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return {"fp32_master_weights": fp32_master, "train_to_generate_ms": 1e3 * min(to_gen[1:]),
            "generate_to_train_ms": 1e3 * min(to_train[1:]), "cache_alloc_ms": 1e3 * min(alloc[1:])}


def bench_hf(model, preset: str, B: int, P: int, R: int, dev: torch.device) -> dict[str, Any]:
    cfg = model.config
    prompts = make_prompts(B, P, cfg.vocab_size, dev).batch
    kw = dict(input_ids=prompts["input_ids"], attention_mask=prompts["attention_mask"], max_new_tokens=R,
              min_new_tokens=R, do_sample=True, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=cfg.pad_token_id,
              cache_implementation="static")
    with torch.no_grad():
        _, t_first = timed(lambda: model.generate(**kw), dev)
        out, t = timed(lambda: model.generate(**kw), dev)
    return {"engine": "hf_generate_static_cache", "preset": preset, "batch": B, "prompt_len": P, "new_tokens": R,
            "first_call_s": t_first, "generate_s": t, "tokens_per_s": B * (out.shape[1] - P) / t}


def _record(report: dict[str, Any], name: str, fn: Any) -> None:
    try:
        res = fn()
    except Exception as err:  # noqa: BLE001 — a failed case is recorded, the others still run
        log.exception("%s failed", name)
        report["errors"].append(f"{name}: {type(err).__name__}: {err}")
        return
    if res is not None:
        log.info("%s", json.dumps(res))
        report["switch" if name.startswith("switch") else "results"].append(res)


def run_preset(preset: str, batches: list[int], hf_cases: set, with_switch: bool, dev: torch.device,
               dtype: torch.dtype, bw: float, args: argparse.Namespace, report: dict[str, Any], save: Any) -> None:
    model = make_model(preset, dev, dtype)
    P, R = args.prompt_len, args.new_tokens
    for B in batches:
        for q in args.quantization.split(","):
            _record(report, f"hybridflow {preset} b{B} {q}",
                    lambda: bench_engine(model, preset, B, P, R, dev, bw, args, q))  # noqa: B023
            save()
        if (preset, B) in hf_cases:
            _record(report, f"hf {preset} b{B}", lambda: bench_hf(model, preset, B, P, R, dev))  # noqa: B023
            save()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    if with_switch:
        for fp32 in (False, True):
            _record(report, f"switch {preset} fp32={fp32}",
                    lambda: {"preset": preset, **bench_switch(model, dev, 64, 16, fp32)})  # noqa: B023
            save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default="qwen2.5-0.5b:256,qwen2.5-0.5b:1024,qwen2.5-1.5b:256,qwen2.5-1.5b:1024",
                    help="preset:batch list")
    ap.add_argument("--hf-cases", default="qwen2.5-0.5b:256",
                    help="preset:batch list for HF generate (static cache; its first call compiles)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prefill-tokens", type=int, default=65536, help="rollout.max_num_batched_tokens")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--eager", action="store_true", help="rollout.enforce_eager (no CUDA graphs, no compile)")
    ap.add_argument("--no-compile", action="store_true", help="CUDA graphs of eager ops (no torch.compile)")
    ap.add_argument("--profile", action="store_true", help="kernel breakdown of one generate per case")
    ap.add_argument("--sdpa", action="store_true", help="SDPA and the torch sampler instead of our Triton kernels")
    ap.add_argument("--quantization", default="none",
                    help="rollout.quantization values to run every case with, e.g. none,fp8")
    ap.add_argument("--mismatch-rows", type=int, default=64,
                    help="rows scored by an HF forward for the log-prob mismatch (0 = skip)")
    ap.add_argument("--fp32-master", action="store_true",
                    help="fp32 parameters generating in bf16 (the RL setting: cast into fused buffers)")
    args = ap.parse_args()
    if args.sdpa:
        forward._triton_attention = lambda device: None
        # the torch sampler as chosen off CUDA (compiled when the decode ops are)
        rollout_engine.build_sampler = lambda device, compiled: sampling.build_sampler(torch.device("cpu"), compiled)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    report: dict[str, Any] = {
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor(),
        "args": vars(args), "results": [], "switch": [], "errors": [],
    }
    bw = copy_bandwidth(dev) if dev.type == "cuda" else copy_bandwidth(dev, 0.25)
    report["copy_bandwidth_GBps"] = bw / 1e9
    log.info("device copy bandwidth %.0f GB/s", bw / 1e9)

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    cases = [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases.split(",") if c]
    hf_cases = {(c.split(":")[0], int(c.split(":")[1])) for c in args.hf_cases.split(",") if c}
    for i, preset in enumerate(dict.fromkeys(p for p, _ in cases)):
        batches = [b for p, b in cases if p == preset]
        run_preset(preset, batches, hf_cases, i == 0, dev, dtype, bw, args, report, save)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    save()
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
