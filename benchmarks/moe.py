"""MoE generation: decode tokens/s of our engine vs HF `generate` (the fallback), and the trainer's log-prob gap to
the rollout with and without routing replay.

Random-init Qwen3-30B-A3B shape (48 layers, hidden 2048, 128 experts, 8 per token, expert width 768; bf16 ≈ 61 GB,
no download), random prompts, sampling with ignore_eos. The "trainer" is HF's own forward over the generated rows
in the same dtype (its kernels, not ours) — with its routers free, then replaying `routed_experts`.
One H200:   PYTHONPATH=. python -m benchmarks.moe --out $OUT/moe.json
CPU smoke:  PYTHONPATH=. python -m benchmarks.moe --smoke --out moe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from benchmarks import harness
from benchmarks.rollout import timed
from hybridflow.config import load_config
from hybridflow.engine.moe_replay import routing_replay
from hybridflow.protocol import DataProto
from hybridflow.rollout import RolloutEngine

log = logging.getLogger("bench.moe")
SHAPES = {
    "qwen3-30b-a3b": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                          intermediate_size=6144, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, intermediate_size=96,
                 vocab_size=512),
}


def make_model(shape: str, layers: int | None, dev: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    kw = dict(SHAPES[shape], norm_topk_prob=True, max_position_embeddings=4096, pad_token_id=0, eos_token_id=1,
              bos_token_id=2, initializer_range=0.02)
    if layers:
        kw["num_hidden_layers"] = layers
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**kw), dtype=dtype)
    return model.eval()


def prompts_for(B: int, P: int, vocab: int, dev: torch.device) -> DataProto:
    ids = torch.randint(3, vocab, (B, P), generator=torch.Generator().manual_seed(0))
    return DataProto.from_single_dict({"input_ids": ids.to(dev), "attention_mask": torch.ones(B, P, dtype=torch.long,
                                       device=dev), "position_ids": torch.arange(P, device=dev).expand(B, P).clone()})


def bench_ours(model, B: int, P: int, R: int, dev: torch.device, eager: bool) -> tuple[dict[str, Any], DataProto]:
    rcfg = dataclasses.replace(load_config([], []).rollout, n=1, temperature=1.0, ignore_eos=True, max_num_seqs=B,
                               free_cache_engine=False, enforce_eager=eager, gpu_memory_utilization=0.85)
    engine = RolloutEngine(model, rcfg, eos_token_id=1, pad_token_id=0, max_prompt_length=P, max_response_length=R)
    assert not engine.uses_hf_fallback, "the MoE model fell back to HF generate"
    prompts = prompts_for(B, P, model.config.vocab_size, dev)
    _, first = timed(lambda: engine.generate(prompts), dev)  # cache, compile, graph capture
    out, t_gen = timed(lambda: engine.generate(prompts), dev)
    one = DataProto.from_single_dict(dict(prompts.batch), meta_info={"max_new_tokens": 1})
    _, t_prefill = timed(lambda: engine.generate(one), dev)
    metrics = out.meta_info.get("metrics", {})
    t_route = metrics.get("timing/rollout_routing", 0.0)
    t_decode = max(t_gen - t_prefill - t_route, 1e-9)
    runner = engine._runner
    res = {"first_call_s": first, "generate_s": t_gen, "prefill_s": t_prefill, "routing_record_s": t_route,
           "decode_tokens_per_s": B * (R - 1) / t_decode, "decode_step_ms": 1e3 * t_decode / (R - 1),
           "cuda_graphs": sorted(runner.graphs), "compiled": runner.ops.is_compiled}
    engine.release_cache()
    return res, out


def bench_hf(model, B: int, P: int, R: int, dev: torch.device) -> dict[str, Any]:
    batch = prompts_for(B, P, model.config.vocab_size, dev).batch
    kw = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=R,
              min_new_tokens=R, do_sample=True, top_k=0, top_p=1.0, pad_token_id=0)
    with torch.no_grad():
        timed(lambda: model.generate(**{**kw, "max_new_tokens": 2, "min_new_tokens": 2}), dev)  # warm-up
        _, t = timed(lambda: model.generate(**kw), dev)
    return {"generate_s": t, "tokens_per_s": B * R / t, "new_tokens": R}


def logprob_gap(model, out: DataProto, replay: bool, rows: int) -> dict[str, float]:
    """HF's forward over the generated rows (`rows` at a time): mean |log-prob − rollout log-prob| over response
    tokens, and the fraction of them whose predicting position routes as the rollout did in every MoE layer."""
    b = out.batch
    P = b["prompts"].shape[1]
    gaps, agree, n = 0.0, 0.0, 0
    for i in range(0, b["input_ids"].shape[0], rows):
        s = slice(i, i + rows)
        ids, mask, routes = b["input_ids"][s], b["attention_mask"][s], b["routed_experts"][s]
        with torch.no_grad(), routing_replay(model, routes, mask, False, replay, ids.device) as agreed:
            logits = model(input_ids=ids, attention_mask=mask, position_ids=b["position_ids"][s]).logits
        logp = torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(-1, b["responses"][s][..., None])[..., 0]
        m = b["response_mask"][s].bool()
        gaps += float((logp - b["rollout_log_probs"][s]).abs()[m].sum())
        agree += float(agreed[0].view(ids.shape)[:, P - 1:-1][m].float().sum())
        n += int(m.sum())
    return {"logprob_gap": gaps / n, "routing_agreement": agree / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="fewer decoder layers than the shape's")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--hf-new-tokens", type=int, default=32, help="HF generate is slow: fewer tokens")
    ap.add_argument("--eager", action="store_true", help="no torch.compile / CUDA graphs in our engine")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape, a few tokens")
    ap.add_argument("--out", default="moe.json")
    args = ap.parse_args()
    harness.apply_smoke(args, dict(device="cpu", shape="tiny", batch=4, prompt_len=16, new_tokens=8,
                                   hf_new_tokens=4))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = make_model(args.shape, args.layers, dev, dtype)
    B, P, R = args.batch, args.prompt_len, args.new_tokens
    result: dict[str, Any] = {"env": harness.environment(), "shape": args.shape,
                              "layers": model.config.num_hidden_layers, "batch": B, "prompt_len": P, "new_tokens": R,
                              "dtype": str(dtype)}
    ours, out = bench_ours(model, B, P, R, dev, args.eager)
    result["ours"] = ours
    harness.write_json(args.out, result)
    rows = max(1, 8192 // (P + R))
    result["trainer_vs_rollout"] = {"no_replay": logprob_gap(model, out, False, rows),
                                    "replay": logprob_gap(model, out, True, rows)}
    harness.write_json(args.out, result)
    result["hf"] = bench_hf(model, B, P, args.hf_new_tokens, dev)
    result["speedup_decode"] = ours["decode_tokens_per_s"] / result["hf"]["tokens_per_s"]
    harness.write_json(args.out, result)
    harness.emit_json_line({k: v for k, v in result.items() if k != "env"}, None)


if __name__ == "__main__":
    main()
