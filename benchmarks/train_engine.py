"""Benchmark the FSDP2 TrainEngine: packed forward+backward throughput, MFU and peak memory, and the memory of the
chunked log-prob pass as the number of tokens grows.

GPU (one H200):  PYTHONPATH=. python3 benchmarks/train_engine.py --out $OUT/train_engine.json
CPU smoke test:  PYTHONPATH=. python3 benchmarks/train_engine.py --models tiny --num-seqs 8 --seq-len 64 \
                     --max-token-len 256 --logprob-tokens 128,256 --out /tmp/te.json
MFU counts 6·N·tokens + causal attention (hybridflow/engine/flops.py) against 989 TFLOP/s bf16 dense per GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hybridflow.algorithms.aggregation import agg_loss
from hybridflow.config import load_config
from hybridflow.engine import HeadRequest, TrainEngine, UpdatePlan, attention, train_update
from hybridflow.engine.attention import packed_backend
from hybridflow.engine.flops import FlopsCounter, peak_flops
from hybridflow.protocol import DataProto
from hybridflow.workers.engine_specs import actor_spec

log = logging.getLogger("bench.train_engine")


def make_batch(num_seqs: int, seq_len: int, vocab: int, variable: bool, seed: int = 0) -> DataProto:
    """verl layout: prompt = first half (left-padded), response = second half (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    P = seq_len // 2
    R = seq_len - P
    ids = torch.randint(3, vocab, (num_seqs, seq_len), generator=g)
    mask = torch.ones(num_seqs, seq_len, dtype=torch.long)
    if variable:
        for b in range(num_seqs):
            mask[b, : int(torch.randint(0, P - 1, (1,), generator=g))] = 0
            mask[b, P + int(torch.randint(1, R + 1, (1,), generator=g)):] = 0
    ids = ids * mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    adv = torch.randn(num_seqs, 1, generator=g).expand(num_seqs, R).contiguous()
    return DataProto.from_dict(
        tensors=dict(input_ids=ids, attention_mask=mask, position_ids=pos, responses=ids[:, P:],
                     response_mask=mask[:, P:], advantages=adv),
        meta_info={"n": 1},
    )


def pg_loss(outputs: dict[str, torch.Tensor], mb: DataProto, norm: dict[str, torch.Tensor]):
    """A REINFORCE-style loss: same compute as PPO's (log-probs + backward), no extra state."""
    loss = agg_loss(-mb.batch["advantages"] * outputs["log_probs"], mb.batch["response_mask"], "token-mean",
                    norm["token-mean"])
    return loss, {}


VARIANTS = {"eager": (False, False), "compile": (False, True), "ckpt": (True, False), "compile+ckpt": (True, True)}


def build_engine(model: str, args: argparse.Namespace, variant: str, num_seqs: int) -> TrainEngine:
    grad_ckpt, compiled = VARIANTS[variant]
    overrides = [
        f"model.preset={model}", f"model.enable_gradient_checkpointing={str(grad_ckpt).lower()}",
        f"model.use_torch_compile={str(compiled).lower()}",
        f"data.train_batch_size={num_seqs}", f"actor.ppo_mini_batch_size={num_seqs}",
        f"actor.ppo_micro_batch_size_per_gpu={num_seqs}", "actor.use_dynamic_bsz=true",
        f"actor.ppo_max_token_len_per_gpu={args.max_token_len}",
        # One micro-batch per log-prob pass, so its peak memory shows how it scales with tokens.
        f"actor.log_prob_max_token_len_per_gpu={max(int(t) for t in args.logprob_tokens.split(','))}",
        f"actor.logprob_chunk_size={args.chunk_size}", "actor.optim.lr=1e-6", "actor.shuffle=false",
        f"data.max_prompt_length={args.seq_len // 2}", f"data.max_response_length={args.seq_len - args.seq_len // 2}",
    ]
    if args.num_layers:
        overrides.append(f"model.override_config={{num_hidden_layers: {args.num_layers}}}")
    cfg = load_config(files=[], overrides=overrides)
    return TrainEngine(actor_spec(cfg), device=args.device)


def _head(args: argparse.Namespace) -> HeadRequest:
    return HeadRequest("lm", 1.0, args.chunk_size, False)


def _logprobs(engine: TrainEngine, data: DataProto, args: argparse.Namespace) -> torch.Tensor:
    return engine.infer(data, _head(args))["log_probs"]


def _train(engine: TrainEngine, data: DataProto, args: argparse.Namespace) -> dict[str, float]:
    return train_update(engine, data, pg_loss, _head(args), UpdatePlan(len(data)))


def mem_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def bench_train(engine: TrainEngine, data: DataProto, args: argparse.Namespace) -> dict[str, Any]:
    steps = args.steps
    _train(engine, data, args)  # warm-up (allocator, optimizer state)
    reset_peak()
    runs = [_train(engine, data, args) for _ in range(steps)]
    tokens = float(data.batch["attention_mask"].sum())
    step_s = sum(r["step_time_s"] for r in runs) / steps
    out = {
        "step_time_s": step_s,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step_s,
        "mfu": sum(r["mfu"] for r in runs) / steps if "mfu" in runs[0] else None,
        "peak_mem_gib": mem_gib(),
        "grad_norm": runs[-1]["grad_norm"],
    }
    return out


def bench_logprobs(engine: TrainEngine, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    """Peak memory of one log-prob forward as tokens grow (one micro-batch each): must track tokens × hidden,
    not tokens × vocab (the fp32 logits a naive pass would build are listed for contrast)."""
    rows = []
    flops = FlopsCounter(engine.module.config)
    for tokens in [int(t) for t in args.logprob_tokens.split(",")]:
        n = max(1, tokens // args.seq_len)
        data = make_batch(n, args.seq_len, vocab, variable=False, seed=1)
        _logprobs(engine, data, args)  # warm-up
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        reset_peak()
        base = torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else None
        t0 = time.perf_counter()
        _logprobs(engine, data, args)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        peak = mem_gib()
        resp_tokens = n * (args.seq_len - args.seq_len // 2)
        pk = peak_flops(engine.device)
        rows.append({
            "tokens": n * args.seq_len, "response_tokens": resp_tokens, "time_s": dt,
            "tokens_per_s": n * args.seq_len / dt,
            "mfu": flops.forward_flops([args.seq_len] * n, resp_tokens) / dt / pk if pk else None,
            "peak_mem_gib": peak, "peak_minus_resident_gib": None if base is None else peak - base,
            "naive_fp32_logits_gib": resp_tokens * vocab * 4 / 2**30,
        })
        log.info("logprob pass %s", rows[-1])
    return rows


def check_offload(engine: TrainEngine, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    """to_mode offload/train round trip: device memory freed and identical log-probs afterwards."""
    data = make_batch(4, args.seq_len, vocab, variable=True, seed=2)
    before = _logprobs(engine, data, args)
    alloc = (lambda: torch.cuda.memory_allocated() / 2**30) if torch.cuda.is_available() else (lambda: None)
    on_device = alloc()
    engine.to_mode("offload")
    offloaded = alloc()
    engine.to_mode("train")
    after = _logprobs(engine, data, args)
    return {"allocated_gib_train": on_device, "allocated_gib_offloaded": offloaded,
            "logprobs_identical_after_reload": bool(torch.equal(before, after))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen2.5-0.5b,qwen2.5-1.5b")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--variable-lengths", action="store_true", help="random left/right padding instead of full rows")
    p.add_argument("--max-token-len", type=int, default=16384, help="tokens per packed micro-batch")
    p.add_argument("--chunk-size", type=int, default=2048, help="actor.logprob_chunk_size")
    p.add_argument("--variants", default="eager,compile,compile+ckpt",
                   help=f"comma-separated engine settings to measure, of {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--logprob-tokens", default="8192,32768,65536", help="token counts for the log-prob memory test")
    p.add_argument("--num-layers", type=int, default=0, help="override num_hidden_layers (smoke tests)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")

    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    results: dict[str, Any] = {
        "args": vars(args), "torch": torch.__version__, "python": platform.python_version(),
        "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor(),
        "peak_tflops_assumed": (peak_flops(torch.device(args.device)) or 0) / 1e12, "models": {},
    }
    for model in args.models.split(","):
        entry: dict[str, Any] = {}
        for variant in args.variants.split(","):
            engine = None
            try:
                engine = build_engine(model, args, variant, args.num_seqs)
                vocab = engine.module.config.vocab_size
                data = make_batch(args.num_seqs, args.seq_len, vocab, args.variable_lengths)
                entry[f"train_{variant}"] = bench_train(engine, data, args)
                entry["packed_attention"] = packed_backend(engine.device, engine.compute_dtype)
                entry["varlen_error"] = attention._varlen_error
                log.info("%s %s %s", model, variant, entry[f"train_{variant}"])
                if "logprob_memory" not in entry:
                    entry["logprob_memory"] = bench_logprobs(engine, args, vocab)
                    entry["offload_round_trip"] = check_offload(engine, vocab, args)
                    log.info("offload %s", entry["offload_round_trip"])
            except Exception as e:  # record and go on: one failed setting must not lose the others' numbers
                entry[f"train_{variant}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                log.exception("%s %s failed", model, variant)
            finally:
                engine = None
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
        results["models"][model] = entry
        Path(args.out).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
