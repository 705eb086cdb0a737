"""Data and reward throughput: tokenisation through the dataloader (num_workers 0 vs 2) and reward scoring of
4096 responses (in-process vs a pool of 1 and 2 processes).

    .venv/bin/python benchmarks/data.py [--prompts 16384] [--responses 4096] [--tokenizer LOCAL_HF_DIR]

Prompts are GSM8K-length (~250 characters) chat prompts; the default tokenizer is the built-in char-level one
(one token per character), so tokens/s are comparable across machines. Reward scoring is timed for the cheap
gsm8k scorer and the symbolic math scorer (math-verify), steady state (pool start-up reported separately).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from hybridflow.config import load_config
from hybridflow.data import RLHFDataset, make_dataloader
from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.protocol import DataProto
from hybridflow.rewards import RewardManager


def _prompt_rows(n: int, rng: random.Random) -> list[dict]:
    words = ["apples", "train", "leaves", "costs", "dollars", "each", "friends", "shares", "total", "minutes"]
    rows = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(40)) + f" {rng.randint(1, 999)}?"
        rows.append({"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": text}],
                     "reward_model": {"style": "rule", "ground_truth": str(i % 100)}, "extra_info": {"index": i}})
    return rows


def bench_tokenisation(tokenizer, n: int, workers: int, batch_size: int = 256) -> dict:
    ds = RLHFDataset(_prompt_rows(n, random.Random(0)), tokenizer, max_prompt_length=1024, truncation="left")
    overrides = [f"data.num_workers={workers}"] + (["data.prefetch_factor=4"] if workers else [])
    cfg = load_config([], overrides).data
    loader = make_dataloader(ds, cfg, batch_size, shuffle=True, drop_last=False)
    start = time.perf_counter()
    tokens = sum(int(b.batch["attention_mask"].sum()) for b in loader)
    dt = time.perf_counter() - start
    return {"num_workers": workers, "prompts_per_s": n / dt, "tokens_per_s": tokens / dt, "seconds": dt}


def _responses(tokenizer, n: int, kind: str, width: int) -> DataProto:
    rng = random.Random(1)
    texts, truths, sources = [], [], []
    for i in range(n):
        if kind == "gsm8k":
            truth = str(rng.randint(0, 999))
            answer = truth if rng.random() < 0.5 else str(rng.randint(0, 999))
            texts.append(f"First add the numbers, then multiply. The result is {answer}.\n#### {answer}")
            sources.append("openai/gsm8k")
        else:
            a, b = rng.randint(1, 9), rng.randint(2, 9)
            truth = f"\\frac{{{a}}}{{{b}}}"
            answer = f"{a / b:.6f}".rstrip("0") if i % 2 else f"\\dfrac{{{a}}}{{{b}}}"
            texts.append(f"Simplify the ratio carefully. So the answer is $\\boxed{{{answer}}}$.")
            sources.append("lighteval/MATH")
        truths.append(truth)
    enc = [tokenizer(t, add_special_tokens=False)["input_ids"][:width] for t in texts]
    resp = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros_like(resp)
    for i, ids in enumerate(enc):
        resp[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    return DataProto.from_dict({"responses": resp, "response_mask": mask},
                               {"data_source": sources, "reward_model": [{"ground_truth": t} for t in truths]})


def bench_rewards(tokenizer, n: int, kind: str, workers: int, width: int = 128) -> dict:
    batch = _responses(tokenizer, n, kind, width)
    cfg = load_config([], [f"reward.num_workers={workers}"]).reward
    start = time.perf_counter()
    manager = RewardManager(cfg, tokenizer, width)
    manager.score(batch[:8])  # warm: workers forked, scorer modules imported
    startup = time.perf_counter() - start
    start = time.perf_counter()
    out = manager.score(batch)
    dt = time.perf_counter() - start
    manager.close()
    return {"scorer": kind, "num_workers": workers, "responses_per_s": n / dt, "seconds": dt,
            "startup_s": startup, "mean_reward": float(out.scores.mean()), "errors": out.metrics["reward/errors"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16384)
    parser.add_argument("--responses", type=int, default=4096)
    parser.add_argument("--tokenizer", default=None, help="local HF tokenizer directory (default: built-in)")
    args = parser.parse_args()
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tokenizer = builtin_tokenizer()
    results = [bench_tokenisation(tokenizer, args.prompts, w) for w in (0, 2)]
    for kind in ("gsm8k", "math"):
        results += [bench_rewards(tokenizer, args.responses, kind, w) for w in (0, 1, 2)]
    for r in results:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))


if __name__ == "__main__":
    main()
