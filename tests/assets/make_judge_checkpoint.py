"""Regenerate the committed arithmetic judge `tests/assets/judge_arithmetic/` (the LLM-as-judge learning test):

    OMP_NUM_THREADS=1 .venv/bin/python tests/assets/make_judge_checkpoint.py

SFT (cross-entropy on the verdict and EOS; a plain loop, ~5 minutes on a busy CPU) of a 2-layer, 64-wide model
with the built-in character tokenizer on `TEMPLATE` filled with a response to a 2-digit addition problem and its
ground truth; the target is "1" when the `arithmetic` scorer counts the response exactly right (`acc`), else "0".
Responses imitate what the quickstart policy writes: the right answer, the answer one off (the warm start's habit),
a digit changed, dropped or added, another number, or a malformed line. Writes the HF directory and `provenance.json` (steps, val loss, agreement on held-out rows, versions, CPU).
"""

from __future__ import annotations

import json
import math
import platform
import random
import shutil
from pathlib import Path
from typing import Any

import torch

ASSETS = Path(__file__).resolve().parent
ROOT = ASSETS.parents[1]
OUT = ASSETS / "judge_arithmetic"
TEMPLATE = "{response} T:{ground_truth} V:"  # the judge's reward.judge.template; verdict "1" or "0"
STEPS, BATCH, LR = 2000, 64, 3e-3
SHAPE = {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2}


def _near_miss(truth: int, rng: random.Random) -> str:
    digits = list(str(truth))
    i = rng.randrange(len(digits))
    kind = rng.choice(("change", "drop", "add"))
    if kind == "change":
        digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
    elif kind == "drop" and len(digits) > 1:
        del digits[i]
    else:
        digits.insert(i, rng.choice("0123456789"))
    return "".join(digits)


def response_for(truth: int, rng: random.Random) -> str:
    """A response as the quickstart policy might write it (right about 40% of the time)."""
    u = rng.random()
    if u < 0.40:
        answer = str(truth)
    elif u < 0.60:
        answer = str(truth + 1)
    elif u < 0.70:
        answer = str(max(truth - 1, 0) if truth else 1)
    elif u < 0.85:
        answer = _near_miss(truth, rng)
    elif u < 0.95:
        answer = str(rng.randrange(199))
    else:
        return "".join(rng.choice("0123456789# ") for _ in range(rng.randrange(1, 9)))
    return f"#### {answer}"


def judge_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """`n` SFT rows: prompt = the filled template, response = the verdict ("1"/"0") by the rule scorer's `acc`."""
    from hybridflow.rewards.judge import render
    from hybridflow.rewards.synthetic import arithmetic

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        prompt, truth = f"What is {a:02d}+{b:02d}?", str(a + b)
        response = response_for(a + b, rng)
        right = arithmetic("hybridflow/arithmetic", response, truth)["acc"] == 1.0
        rows.append({"prompt": render(TEMPLATE, prompt, response, truth), "response": "1" if right else "0"})
    return rows


def encode(rows: list[dict[str, Any]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids [N, T], attention mask and labels (-100 except the verdict and the EOS after it)."""
    from hybridflow.models.tokenizer import builtin_tokenizer

    tok = builtin_tokenizer()
    seqs = [(tok(r["prompt"], add_special_tokens=False)["input_ids"],
             tok(r["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]) for r in rows]
    width = max(len(p) + len(v) for p, v in seqs)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    for i, (p, v) in enumerate(seqs):
        ids[i, :len(p) + len(v)] = torch.tensor(p + v)
        labels[i, len(p):len(p) + len(v)] = torch.tensor(v)
    return ids, (ids != tok.pad_token_id).long(), labels


def train(steps: int = STEPS, seed: int = 0, log_every: int = 250) -> Any:
    """SFT: next-token cross-entropy on the verdict (and EOS) of fresh judge rows, AdamW with warm-up + cosine."""
    from transformers import AutoModelForCausalLM

    from hybridflow.models.presets import preset_config

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(preset_config("tiny", **SHAPE))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    warm = 50
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, max(0, s - warm) / max(1, steps - warm))))))
    ids, mask, labels = encode(judge_rows(BATCH * steps, seed + 10))
    val_ids, val_mask, val_labels = encode(judge_rows(512, seed + 20))
    for step in range(steps):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        loss = model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if (step + 1) % log_every == 0 or step + 1 == steps:
            with torch.no_grad():
                val = model(input_ids=val_ids, attention_mask=val_mask, labels=val_labels).loss.item()
            print(f"step {step + 1}: loss {loss.item():.4f} val {val:.4f}", flush=True)
    return model.eval(), val


def main() -> None:
    import transformers

    from hybridflow.models.loader import save_pretrained
    from hybridflow.models.tokenizer import builtin_tokenizer

    torch.set_num_threads(1)
    model, val = train()
    if OUT.exists():
        shutil.rmtree(OUT)
    save_pretrained(model, OUT, builtin_tokenizer())
    provenance = {"recipe": "tests/assets/make_judge_checkpoint.py", "shape": SHAPE, "template": TEMPLATE,
                  "steps": STEPS, "batch": BATCH, "lr": LR, "val_loss": val,
                  "agreement_held_out": agreement(OUT, judge_rows(1024, 2)), "torch": torch.__version__,
                  "transformers": transformers.__version__, "cpu": platform.processor() or platform.machine()}
    (OUT / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(provenance))


def agreement(judge_dir: Path, rows: list[dict[str, Any]]) -> float:
    """Share of `rows` whose greedy verdict (through the reward path's judge) is the rule's."""
    from hybridflow.config import load_config
    from hybridflow.trainer.judge import Judge

    cfg = load_config([], [f"reward.judge.path={judge_dir}", "reward.judge.template='{prompt}'",
                           "reward.judge.verdict_regex=([01])", "reward.judge.max_new_tokens=2",
                           "reward.judge.max_prompt_length=48", "reward.judge.fallback_score=-1"]).reward.judge
    judge = Judge(cfg, device="cpu")
    verdicts = judge([r["prompt"] for r in rows], [""] * len(rows), [None] * len(rows))
    return float(sum(v == float(r["response"]) for v, r in zip(verdicts.scores, rows)) / len(rows))


if __name__ == "__main__":
    main()
