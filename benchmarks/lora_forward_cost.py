"""The other way to give the rollout W + (alpha/r)·B·A: a low-rank term in the engine's forward instead of
merging at each switch. This measures what that term alone would add to one rollout — a lower bound on its cost,
since the forward itself is not built — to compare with the measured merge switch (`benchmarks/lora_gpu.py
--parts switch_0.5b`).

For every adapted projection of every layer (all-linear: q, k, v, o, gate, up, down) the term is
`y += s · (x @ Aᵀ) @ Bᵀ`: two GEMMs, one `[tokens, in] × [in, r]` and one `[tokens, r] × [r, out]` added into y.
Timed as the rollout would run it: decode steps at the batch's rows (all 168 pairs of a step captured in one CUDA
graph, as the engine's decode graph would hold them; CUDA-event timing of its replays, `decode_attention.time_graph`),
and the prefill of the batch's prompt tokens in chunks (median host time, `algorithms.bench`).

    python3 -m benchmarks.lora_forward_cost                       # Qwen2.5-0.5B shape, rank 64, 256 rows, 256 + 256
    python3 -m benchmarks.lora_forward_cost --device cpu --layers 2 --rows 8 --prompt-len 16 --response-len 4  # smoke

Prints one JSON line: ms per decode step, ms of the prefill, and the rollout total (decode steps × response
length + prefill).
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.algorithms import bench
from benchmarks.decode_attention import time_graph
from hybridflow.models.presets import PRESETS


def projections(cfg: dict) -> list[tuple[str, int, int]]:
    """(name, in, out) of every adapted projection of one decoder layer (all-linear)."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    return [("q", h, h), ("k", h, kv), ("v", h, kv), ("o", h, h), ("gate", h, inter), ("up", h, inter),
            ("down", inter, h)]


class LowRankTerm:
    """The factors of every adapted matrix and the buffers the term reads and writes, for `tokens` rows at a time."""

    def __init__(self, cfg: dict, layers: int, rank: int, tokens: int, dtype: torch.dtype, device: str) -> None:
        self.scale = 1.0
        self.work = []
        for _ in range(layers):
            for _, d_in, d_out in projections(cfg):
                a = torch.randn(rank, d_in, dtype=dtype, device=device) * d_in ** -0.5
                b = torch.randn(d_out, rank, dtype=dtype, device=device) * rank ** -0.5
                x = torch.randn(tokens, d_in, dtype=dtype, device=device)
                y = torch.zeros(tokens, d_out, dtype=dtype, device=device)
                mid = torch.empty(tokens, rank, dtype=dtype, device=device)
                self.work.append((x, a, b, mid, y))

    def __call__(self) -> None:
        for x, a, b, mid, y in self.work:
            torch.mm(x, a.t(), out=mid)
            y.addmm_(mid, b.t(), alpha=self.scale)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--rows", type=int, default=256, help="sequences decoding at once (32 prompts × 8)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=256)
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="prompt tokens per prefill forward")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    cfg = PRESETS[args.preset]
    layers = args.layers or cfg["num_hidden_layers"]
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32

    decode = LowRankTerm(cfg, layers, args.rank, args.rows, dtype, args.device)
    if args.device == "cuda":  # the step's GEMMs in one CUDA graph, timed by CUDA events over its replays
        decode_ms = time_graph(lambda _: decode(), iters=1, reps=args.iters) / 1e3
    else:
        decode_ms = bench(decode, args.iters, args.device)[0] * 1e3

    prompt_tokens = args.rows * args.prompt_len
    chunk = min(args.prefill_chunk, prompt_tokens)
    prefill = LowRankTerm(cfg, layers, args.rank, chunk, dtype, args.device)
    prefill_ms = bench(prefill, max(3, args.iters // 4), args.device)[0] * 1e3 * (prompt_tokens / chunk)

    row = {"preset": args.preset, "layers": layers, "rank": args.rank, "rows": args.rows,
           "adapted_pairs_per_step": len(projections(cfg)) * layers, "device": args.device,
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
           "decode_step_ms": round(decode_ms, 4), "prefill_ms": round(prefill_ms, 3),
           "rollout_ms": round(decode_ms * args.response_len + prefill_ms, 2)}
    print(json.dumps(row))


if __name__ == "__main__":
    main()
