"""Exact log-probs (`actor_rollout.exact_logprobs`) against the default: one GRPO-shaped step per mode on the same
random-init model — generation, the trainer's log-prob pass, one update, each timed at its second call — with the gap
between the rollout's log-probs and the trainer's (max |Δ|, share of tokens whose ratio leaves [0.99, 1.01]) and the time of each stage.

GPU (one H200):  PYTHONPATH=. python3 benchmarks/exact_logprobs.py --out $OUT/exact_grpo.json  (then
                 --mini-batches 4 --out $OUT/exact_ppo4.json; --preset qwen2.5-1.5b for the larger shape)
CPU smoke test:  PYTHONPATH=. python3 benchmarks/exact_logprobs.py --preset tiny --prompts 2 --n 2 --prompt-len 16 \
                     --response-len 8 --out /tmp/exact.json
CPU update cost: the same with --prompts 8 --n 4 --prompt-len 128 --response-len 128 (exact mode's backward is the
                 plain ops': its update is the default's plus the torch-loop forward)
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hybridflow.config import load_config
from hybridflow.engine import HeadRequest, TrainEngine, UpdatePlan, train_update
from hybridflow.protocol import DataProto
from hybridflow.rollout import RolloutEngine
from hybridflow.workers.engine_specs import actor_spec

log = logging.getLogger("bench.exact_logprobs")


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prompts(B: int, P: int, vocab: int, n: int) -> DataProto:
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(P // 2, P + 1, (B,), generator=g)
    mask = (torch.arange(P)[None] >= (P - lens)[:, None]).long()
    ids = torch.randint(3, vocab, (B, P), generator=g) * mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_single_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                                      meta_info={"n": n, "seeds": list(range(B))})


def _loss(outputs, mb, norm):
    return -(outputs["log_probs"] * mb.batch["response_mask"]).sum() / norm["token-mean"], {}


def run_mode(args: argparse.Namespace, exact: bool, device: str) -> dict[str, float]:
    overrides = [f"model.preset={args.preset}", f"actor_rollout.exact_logprobs={exact}",
                 f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts}",
                 f"actor.ppo_micro_batch_size_per_gpu={args.prompts * args.n}",
                 f"actor.log_prob_micro_batch_size_per_gpu={args.prompts * args.n}", "model.use_torch_compile=false"]
    cfg = load_config([], overrides)
    train = TrainEngine(actor_spec(cfg), device=device)
    rollout = RolloutEngine(train.module, cfg.rollout, eos_token_id=train.module.config.vocab_size - 1,
                            pad_token_id=0, max_prompt_length=args.prompt_len, max_response_length=args.response_len,
                            exact_logprobs=exact)
    prompts = _prompts(args.prompts, args.prompt_len, train.module.config.vocab_size, args.n)
    head = HeadRequest("lm", temperature=cfg.rollout.temperature)
    out, t = None, {}
    for _ in range(2):  # the first call captures graphs / compiles: the second is timed
        _sync()
        t0 = time.perf_counter()
        out = rollout.generate(prompts)
        _sync()
        t["gen_s"] = time.perf_counter() - t0
        log.info("exact=%s generate: %.3f s", exact, t["gen_s"])
    logp = None
    for _ in range(2):  # first calls compile / initialise kernels: the second of each stage is timed
        _sync()
        t0 = time.perf_counter()
        lp = train.infer(out, head)["log_probs"]
        _sync()
        t["old_log_prob_s"] = time.perf_counter() - t0
        logp = lp if logp is None else logp  # the gap is measured on the weights that generated
    log.info("exact=%s log-prob pass: %.3f s", exact, t["old_log_prob_s"])
    for _ in range(2):
        _sync()
        t0 = time.perf_counter()
        train_update(train, out, _loss, head, UpdatePlan(args.prompts * args.n // args.mini_batches))
        _sync()
        t["update_s"] = time.perf_counter() - t0
    log.info("exact=%s update: %.3f s", exact, t["update_s"])
    mask = out.batch["response_mask"].bool()
    delta = (logp - out.batch["rollout_log_probs"])[mask]
    ratio = delta.exp()
    t |= {"max_abs_dlogp": float(delta.abs().max()), "tokens": int(mask.sum()),
          "share_ratio_outside_1pct": float(((ratio < 0.99) | (ratio > 1.01)).float().mean()),
          "step_s_with_recompute": t["gen_s"] + t["old_log_prob_s"] + t["update_s"],
          # sync mode: old log-probs are recomputed with several mini-batches, unless exact mode copies them
          "step_s_sync": t["gen_s"] + t["update_s"] + (t["old_log_prob_s"] if args.mini_batches > 1 and not exact
                                                       else 0.0)}
    del train, rollout
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--response-len", type=int, default=128)
    ap.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per update (GRPO 1, PPO e.g. 4)")
    ap.add_argument("--modes", default="default,exact")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not dist.is_initialized():
        kw = {"device_id": torch.device("cuda", 0)} if device == "cuda" else {}
        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, **kw)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "device": device}
    for mode in args.modes.split(","):
        result[mode] = run_mode(args, mode == "exact", device)
        log.info("%s: %s", mode, json.dumps(result[mode]))
    if "default" in result and "exact" in result:
        result["exact_over_default_step_sync"] = result["exact"]["step_s_sync"] / result["default"]["step_s_sync"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
