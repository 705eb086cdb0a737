"""Weak-start recovery, hybridflow GRPO vs TRL's GRPOTrainer: same start, same sample budget,
same scorer, one greedy evaluator for both.

    python -m benchmarks.learning --seeds 0-2 --sides ours,trl --out runs/learning [--recipe robust] [a.b=c ...]

TRL is needed for the TRL side only, installed for the benchmark, never a hybridflow dependency:
    .venv/bin/pip install trl==1.16.0   (measured with trl 1.16.0, transformers 5.24, accelerate 1.15)

1. Weak start (cached in `<work>/weak_sft`, deterministic): the quickstart's SFT on demonstrations of which 50%
   answer one too high (`sft.label_noise=0.5`), stopped after `WEAK_SFT_STEPS` steps, before the plateau is left
   (stops at its first validation ≤ 0.28, every 50 steps: step 750, val loss 0.233 here), greedy accuracy 24%.
2. Each side trains from it in its own process (1 intra-op thread) with seed s, on the same 32 prompts × 8 samples
   per step (`--prompts`, `--n`), `--steps` steps: the sample budget is prompts × n × steps for both. Ours: the
   quickstart config plus `--recipe` (a list below) plus the overrides on the command line. TRL: `trl_config()`
   says every setting; defaults except the learning rate (1e-6 is its default, for billion-parameter models: we
   give TRL 1e-4, its best of 1e-4 / 3e-4 / 1e-3 on this model in the earlier comparison), the batch shape and the
   completion length.
3. One evaluator (`evaluate`) scores both saved models: greedy decoding of the 256 held-out problems (the task's
   validation split, never trained on), exact-match accuracy by hybridflow's `arithmetic` scorer (`acc`).
Output: `<out>/runs.jsonl` (one line per run) and `<out>/summary.md` (per-seed rows, min / median / max, mean).
`--smoke`: a few tiny steps of our side only (CI); the TRL side is skipped with a message when `import trl` fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import parse_seeds, run_child, write_table

log = logging.getLogger("bench.learning")

WEAK_SFT_STEPS = 1500  # the cap; the weak start stops at WEAK_SFT_VAL_LOSS, on the way down from the plateau
WEAK_SFT_VAL_LOSS = 0.28
WEAK_SFT = ["sft.label_noise=0.5", f"sft.target_val_loss={WEAK_SFT_VAL_LOSS}", "trainer.test_freq=50"]
# The recipes of our side, as config overrides on top of hybridflow/config/quickstart.yaml.
RECIPES: dict[str, list[str]] = {
    "quickstart": [],
    # The recommended recipe for a weak start (docs/tuning.md): the robust preset's lr warm-up, 2x the quickstart's lr,
    # and 4 optimizer steps per generation batch (mini-batches of 8 of the 32 prompts), at the same sample budget.
    "robust": ["algorithm.preset=robust", "actor.optim.lr=2e-4"],
}
MINI_BATCHES = {"robust": 4}  # optimizer steps per generation batch (default 1): ppo_mini_batch_size = prompts / this
SMOKE = ["--prompts", "4", "--n", "4", "--steps", "2", "--eval-size", "16", "--sft-steps", "4"]


# ------------------------------------------------------------------------------------------------- weak start
def quickstart_config(overrides: list[str]) -> Any:
    from hybridflow.commands.quickstart import QUICKSTART_YAML
    from hybridflow.config import load_config

    return load_config([QUICKSTART_YAML], overrides)


def weak_start(work: Path, sft_steps: int = WEAK_SFT_STEPS) -> Path:
    """The blurred SFT warm start as an HF directory, built once per work dir (default seeds, 1 thread)."""
    from hybridflow.tracking import Tracker
    from hybridflow.trainer.sft import run_sft

    out = work / f"weak_sft_{sft_steps}"
    if (out / "provenance.json").exists():
        return out
    run_dir = work / f"weak_sft_{sft_steps}_run"
    overrides = [*WEAK_SFT, f"sft.total_steps={sft_steps}"]
    if sft_steps < WEAK_SFT_STEPS:  # smoke runs: a missed gate would add a 500-step extra schedule (~90 s)
        overrides.append("sft.extra_schedules=0")
    cfg = quickstart_config([f"trainer.run_dir={run_dir}", "trainer.logger=[jsonl]", *overrides])
    with Tracker.from_config(cfg) as tracker:
        run_sft(cfg, out_dir=out, tracker=tracker)
    val = [r for r in _read_jsonl(run_dir / "metrics.jsonl") if "val/loss" in r]
    prov = {"overrides": overrides, "val_loss": [(int(r["training/global_step"]), round(r["val/loss"], 4))
                                                  for r in val]}
    (out / "provenance.json").write_text(json.dumps(prov, indent=1) + "\n")
    return out


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


# ------------------------------------------------------------------------------------------------- problems
def problems(split: str, size: int | None = None) -> list[tuple[str, str]]:
    """(question, answer) of the quickstart's task split ('train' or 'val', the held-out problems)."""
    from hybridflow.data.tasks import task_splits

    cfg = quickstart_config([])
    train, val = task_splits(cfg.data.task, cfg.data.train_size, cfg.data.val_size, cfg.data.seed)
    rows = val if split == "val" else train
    out = [(r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in rows]
    return out[:size] if size else out


def load_tok(model_dir: Path) -> Any:
    """Our loader: transformers' AutoTokenizer would rebuild the char tokenizer as Qwen2Tokenizer (no spaces)."""
    from hybridflow.models.loader import load_tokenizer

    return load_tokenizer(quickstart_config([f"model.path={model_dir}"]).model)


def evaluate(model_dir: Path, size: int | None = None, max_new_tokens: int = 10) -> dict[str, float]:
    """Greedy decoding of the held-out problems; exact-match accuracy (`acc`) and mean score of `arithmetic`.
    Prompts of one length are decoded together, so no padding is involved (every prompt here has 14 chars)."""
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.rewards.synthetic import arithmetic

    tok = load_tok(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    probs = problems("val", size)
    by_len: dict[int, list[tuple[list[int], str]]] = {}
    for q, a in probs:
        ids = tok(q, add_special_tokens=False)["input_ids"]
        by_len.setdefault(len(ids), []).append((ids, a))
    acc = score = 0.0
    with torch.no_grad():
        for length, items in by_len.items():
            ids = torch.tensor([i for i, _ in items])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
            for row, (_, truth) in zip(out[:, length:], items):
                s = arithmetic("hybridflow/arithmetic", tok.decode(row, skip_special_tokens=True), truth)
                acc, score = acc + s["acc"], score + s["score"]
    return {"acc": acc / len(probs), "score": score / len(probs)}


# ------------------------------------------------------------------------------------------------- the two sides
def run_ours(run_dir: Path, weak: Path, seed: int, args: argparse.Namespace, overrides: list[str]) -> dict[str, Any]:
    """hybridflow GRPO from `weak`; the final actor is exported as an HF directory and evaluated."""
    from hybridflow.commands.export import export_hf
    from hybridflow.trainer.run import run_ppo

    cfg = quickstart_config([
        f"model.path={weak}", f"trainer.run_dir={run_dir}", f"trainer.default_local_dir={run_dir}/ckpt",
        "trainer.logger=[jsonl]", "trainer.checkpoint.save_freq=-1", "trainer.val_before_train=false",
        "trainer.test_freq=-1", f"trainer.total_training_steps={args.steps}", f"data.train_batch_size={args.prompts}",
        f"actor.ppo_mini_batch_size={max(1, args.prompts // MINI_BATCHES.get(args.recipe, 1))}", f"rollout.n={args.n}", f"rollout.seed={seed}",
        f"trainer.seed={seed + 1}", *RECIPES[args.recipe], *overrides])
    history = run_ppo(cfg)
    hf = export_hf(run_dir / "ckpt", run_dir / "hf")
    gen_rounds = [m.get("data/gen_batches", 1.0) for m in history if "actor/pg_loss" in m]
    keys = ("reward/score/mean", "actor/entropy", "actor/pg_clipfrac", "actor/grad_norm", "data/frac_groups_filtered")
    curve = {k: [round(m[k], 4) for m in history if k in m] for k in keys}
    return {"model": str(hf), "samples": int(sum(gen_rounds) * cfg.data.train_batch_size * cfg.rollout.n),
            "config": {"lr": cfg.actor.optim.lr, "warmup": cfg.actor.optim.lr_warmup_steps,
                       "loss_agg_mode": cfg.actor.loss_agg_mode, "entropy_coeff": cfg.actor.entropy_coeff,
                       "filter_groups": cfg.algorithm.filter_groups.enable, "n": cfg.rollout.n,
                       "prompts": cfg.data.train_batch_size, "temperature": cfg.rollout.temperature},
            "curve": curve}


def trl_config(run_dir: Path, seed: int, args: argparse.Namespace) -> Any:
    """TRL's GRPOConfig: its defaults (beta 0, loss_type "dapo", scale_rewards "group", epsilon 0.2, num_iterations 1,
    linear lr decay, no warm-up, weight decay 0, max_grad_norm 1.0, temperature 1, AdamW) except the learning rate
    (`--trl-lr`), the batch shape (one optimizer step per generation batch of prompts × n, on-policy) and length."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(run_dir / "trl"), learning_rate=args.trl_lr, num_generations=args.n,
        per_device_train_batch_size=args.prompts * args.n, gradient_accumulation_steps=1,
        max_completion_length=10, max_steps=args.steps, use_cpu=True, bf16=False, seed=seed, logging_steps=5,
        save_strategy="no", report_to="none", dataloader_num_workers=0,
    )


def run_trl(run_dir: Path, weak: Path, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from hybridflow.rewards.synthetic import arithmetic

    def score(completions: list[str], ground_truth: list[str], **_: Any) -> list[float]:
        return [arithmetic("hybridflow/arithmetic", c, t)["score"] for c, t in zip(completions, ground_truth)]

    train = problems("train")
    data = datasets.Dataset.from_dict({"prompt": [q for q, _ in train], "ground_truth": [a for _, a in train]})
    conf = trl_config(run_dir, seed, args)
    model = AutoModelForCausalLM.from_pretrained(str(weak), dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=score, args=conf, train_dataset=data,
                          processing_class=load_tok(weak))
    trainer.train()
    hf = run_dir / "hf"
    trainer.save_model(str(hf))
    logs = trainer.state.log_history
    curve = {k: [round(m[k], 4) for m in logs if k in m] for k in ("reward", "entropy", "grad_norm")}
    settings = {k: str(getattr(conf, k)) for k in (
        "learning_rate", "beta", "loss_type", "scale_rewards", "num_generations", "temperature", "epsilon",
        "epsilon_high", "num_iterations", "max_grad_norm", "lr_scheduler_type", "warmup_steps", "weight_decay",
        "optim", "top_k", "top_p", "mask_truncated_completions", "importance_sampling_level")}
    return {"model": str(hf), "samples": args.steps * args.prompts * args.n, "trl": trl.__version__,
            "config": settings, "curve": curve}


def one_run(side: str, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """One side, one seed, in this process: train, then the shared greedy evaluation of start and end."""
    import torch

    torch.set_num_threads(1)
    work = Path(args.work or args.out)
    weak = weak_start(work, args.sft_steps)
    run_dir = work / f"{side}_{args.recipe if side == 'ours' else 'trl'}_s{seed}"
    start = time.perf_counter()
    row = (run_ours(run_dir, weak, seed, args, args.overrides) if side == "ours" else run_trl(run_dir, weak, seed, args))
    train_s = time.perf_counter() - start
    before = _cached_eval(work, weak, args.eval_size)
    after = evaluate(Path(row.pop("model")), args.eval_size)
    return {**row, "train_seconds": train_s, "start": before["acc"], "end": after["acc"],
            "gain": after["acc"] - before["acc"], "start_score": before["score"], "end_score": after["score"]}


def _cached_eval(work: Path, weak: Path, size: int | None) -> dict[str, float]:
    path = work / f"{weak.name}_eval_{size or 'all'}.json"
    if not path.exists():
        path.write_text(json.dumps(evaluate(weak, size)))
    return json.loads(path.read_text())


# ------------------------------------------------------------------------------------------------- one batch
def loss_terms(work: Path, prompts: int = 32, n: int = 8, seed: int = 0) -> dict[str, float]:
    """Both losses on one on-policy batch from the weak start, term by term: advantages, aggregation, clipping,
    KL, then the gradients. TRL's side is written here from its documented definition (GRPOConfig defaults:
    advantage (r - group mean) / (group std + 1e-4), token ratio clipped to [0.8, 1.2], loss_type "dapo" = the
    token sum over the generation batch's completion tokens, beta 0)."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from hybridflow.algorithms import compute_advantage
    from hybridflow.algorithms.policy_loss import POLICY_LOSSES
    from hybridflow.rewards.synthetic import arithmetic

    torch.manual_seed(seed)
    weak = weak_start(work)
    tok, model = load_tok(weak), AutoModelForCausalLM.from_pretrained(str(weak), dtype=torch.float32)
    batch = problems("train")[:prompts]
    ids = torch.tensor([tok(q, add_special_tokens=False)["input_ids"] for q, _ in batch]).repeat_interleave(n, 0)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                             max_new_tokens=10, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    resp = out[:, ids.shape[1]:]
    ended = (resp == tok.eos_token_id).long().cumsum(-1)
    mask = ((ended == 0) | ((ended == 1) & (resp == tok.eos_token_id))).float()  # through the first EOS
    truths = [a for _, a in batch for _ in range(n)]
    scores = torch.tensor([arithmetic("hybridflow/arithmetic", tok.decode(r, skip_special_tokens=True), t)["score"]
                           for r, t in zip(resp, truths)])
    logits = model(out).logits[:, ids.shape[1] - 1:-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, resp[:, :, None]).squeeze(-1)
    old = logp.detach()
    rewards_bt = torch.zeros_like(mask)
    rewards_bt[torch.arange(len(mask)), mask.sum(-1).long() - 1] = scores
    uid = np.repeat(np.arange(prompts), n)
    adv_ours, _ = compute_advantage("grpo", token_level_rewards=rewards_bt, response_mask=mask, index=uid)
    grouped = scores.view(prompts, n)
    adv_trl = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    loss_ours, m = POLICY_LOSSES["vanilla"](old, logp, adv_ours, mask, clip_ratio_low=0.2, clip_ratio_high=0.2,
                                            clip_ratio_c=3.0, loss_agg_mode="token-mean")
    ratio = torch.exp(logp - old)
    a = adv_trl[:, None]
    loss_trl = (-torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a) * mask).sum() / mask.sum()

    def grad(loss: torch.Tensor) -> torch.Tensor:
        g = torch.autograd.grad(loss, [p for p in model.parameters()], retain_graph=True, allow_unused=True)
        return torch.cat([x.flatten() for x in g if x is not None])

    g_ours, g_trl = grad(loss_ours), grad(loss_trl)
    seq_adv = adv_ours[torch.arange(len(mask)), 0]
    flat = (grouped.max(1).values == grouped.min(1).values).float().mean()
    return {"samples": len(mask), "mean_score": float(scores.mean()), "exact": float((scores == 1).float().mean()),
            "zero_variance_groups": float(flat), "tokens": float(mask.sum()),
            "adv_max_abs_diff": float((seq_adv - adv_trl).abs().max()),
            "adv_rel_diff_max": float(((seq_adv - adv_trl).abs() / adv_trl.abs().clamp(min=1e-8)).max()),
            "loss_ours": float(loss_ours), "loss_trl": float(loss_trl), "pg_clipfrac": float(m["pg_clipfrac"]),
            "grad_norm_ours": float(g_ours.norm()), "grad_norm_trl": float(g_trl.norm()),
            "grad_cosine": float(torch.nn.functional.cosine_similarity(g_ours, g_trl, dim=0))}


# ------------------------------------------------------------------------------------------------- driver
def launch(side: str, seed: int, args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.learning", *argv, "--child", f"{side}:{seed}"]
    row = run_child(cmd, {"side": side, "seed": seed, "recipe": args.recipe if side == "ours" else "trl-defaults",
                          "overrides": args.overrides if side == "ours" else []}, Path(args.out) / "runs.jsonl")
    status = (f"{100 * row['start']:.1f}% → {100 * row['end']:.1f}% ({100 * row['gain']:+.1f})" if "gain" in row
              else f"FAILED rc={row['returncode']}: {row['error'][-500:]}")
    print(f"{side} seed {seed}: {status} ({row['wall_seconds']:.0f}s)", flush=True)
    return row


def summarize(rows: list[dict[str, Any]]) -> str:
    lines = ["| side | recipe | seed | start % | end % | gain (points) | train s |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "gain" in r:
            lines.append(f"| {r['side']} | {r['recipe']} | {r['seed']} | {100 * r['start']:.1f} | {100 * r['end']:.1f}"
                         f" | {100 * r['gain']:+.1f} | {r['train_seconds']:.0f} |")
        else:
            lines.append(f"| {r['side']} | {r['recipe']} | {r['seed']} | failed | | | |")
    lines += ["", "| side | recipe | runs | gain min / median / max | mean gain | end % mean | train s max |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for key in dict.fromkeys((r["side"], r["recipe"]) for r in rows):
        ok = [r for r in rows if (r["side"], r["recipe"]) == key and "gain" in r]
        if not ok:
            continue
        g = [100 * r["gain"] for r in ok]
        lines.append(f"| {key[0]} | {key[1]} | {len(ok)} | {min(g):+.1f} / {statistics.median(g):+.1f} / "
                     f"{max(g):+.1f} | {statistics.mean(g):+.1f} | {100 * statistics.mean(r['end'] for r in ok):.1f}"
                     f" | {max(r['train_seconds'] for r in ok):.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0-2")
    ap.add_argument("--sides", default="ours,trl")
    ap.add_argument("--recipe", default="robust", choices=sorted(RECIPES))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--trl-lr", type=float, default=1e-4)
    ap.add_argument("--sft-steps", type=int, default=WEAK_SFT_STEPS)
    ap.add_argument("--eval-size", type=int, default=None, help="held-out problems evaluated (default: all 256)")
    ap.add_argument("--smoke", action="store_true", help="tiny run of our side only (CI)")
    ap.add_argument("--out", default="runs/learning")
    ap.add_argument("--work", default=None, help="where runs and the cached weak start live (default: --out)")
    ap.add_argument("--loss-terms", action="store_true", help="both losses on one batch, term by term (JSON)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", metavar="a.b=c", help="overrides of our side")
    argv = sys.argv[1:]
    args = ap.parse_intermixed_args(argv + (SMOKE if "--smoke" in argv else []))
    logging.basicConfig(level=logging.WARNING)
    if args.loss_terms:
        import torch

        torch.set_num_threads(1)
        print(json.dumps(loss_terms(Path(args.work or args.out), args.prompts, args.n), indent=1))
        return
    if args.child:
        side, seed = args.child.split(":")
        print(json.dumps(one_run(side, int(seed), args)))
        return
    sides = args.sides.split(",")
    if args.smoke:
        sides = ["ours"]
    if "trl" in sides:
        try:
            import trl  # noqa: F401
        except ImportError as err:
            print(f"TRL side skipped: `import trl` failed ({err}); install it with `pip install trl==1.16.0`",
                  flush=True)
            sides.remove("trl")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows = [launch(side, seed, args, argv) for seed in parse_seeds(args.seeds) for side in sides]
    write_table(Path(args.out) / "summary.md", summarize(rows), append=False)
    if any("gain" not in r for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
