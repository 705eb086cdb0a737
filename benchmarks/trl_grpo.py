"""The peer: the same GRPO workload as `benchmarks/run.py` through TRL's GRPOTrainer (use_vllm=False).

Run on one GPU (TRL and its wheels carried, see the device README):
    PYTHONPATH=/tmp/site:. python3 -m benchmarks.trl_grpo --out $OUT
CPU smoke test:  ... --preset tiny --device cpu --prompts 4 --n 2 --prompt-len 16 --response-len 8 --steps 1
Workload: random-init Qwen2.5 shape, prompts of `prompt-len` random token ids (a word-level tokenizer with one
word per model token id, so every prompt is exactly that many tokens), `n` samples each, `response-len` new
tokens forced (min_new_tokens), KL off (beta=0), bf16 autocast over fp32 weights, one optimizer step per
generation batch (per_device_train_batch_size=n*prompts/ga, gradient_accumulation_steps=ga). TRL is imported only
here; hybridflow does not depend on it. Step time = time between consecutive optimizer-step ends.
`--lora-rank R`: TRL's own PEFT path (`GRPOTrainer(peft_config=LoraConfig(r=R, lora_alpha, all-linear))`,
TRL's defaults otherwise: adapters upcast to fp32, gradient checkpointing on); with `--dtype bfloat16` the frozen
base is held in bf16, as ours is. `benchmarks/lora_gpu.py` calls `run()`.
`--vllm colocate`: TRL's vLLM generation in the training process (`use_vllm=True, vllm_mode="colocate"`; vLLM loads
the random-init model from a directory this script writes; `min_tokens` forces the response length there);
needs vLLM importable beside TRL (benchmarks/vllm_round.sh says how it reaches the device). Generation is then
not timed apart (vLLM's engine is not `model.generate`).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.harness import add_workload_args, write_json

log = logging.getLogger("bench.trl")


def length_mod5(completions: list[str], **kwargs: Any) -> list[float]:
    """The reward `benchmarks/run.py` uses: (len(text) % 5) / 4."""
    return [(len(c) % 5) / 4.0 for c in completions]


def word_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t2"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2",
                                   padding_side="left")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    add_workload_args(ap)
    ap.add_argument("--ga", type=int, default=8, help="gradient accumulation steps per optimizer step")
    ap.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up step)")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--lora-rank", type=int, default=0, help="PEFT LoRA rank on every Linear (0 = full fine-tuning)")
    ap.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default: the rank)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="weights as loaded (bf16 autocast on GPU either way)")
    ap.add_argument("--vllm", choices=["off", "colocate"], default="off",
                    help="TRL's generation: HF generate (off) or vLLM in the training process (colocate)")
    ap.add_argument("--vllm-memory", type=float, default=0.3, help="vllm_gpu_memory_utilization (colocate)")
    return ap


def main() -> None:
    args = parser().parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    res = run(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_json(Path(args.out) / f"trl_{args.preset}.json", res)
    print(f"TRL {res['trl']} GRPO {args.preset}: median step {res['median_step_s']} s "
          f"(generate {res['median_gen_s']} s), peak {max(res['peak_memory_gb'], default='-')} GB")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """TRL's GRPOTrainer on the workload of `args` (see `parser()`); returns the timings and peak memory."""
    try:
        import datasets
        import trl
        from transformers import AutoModelForCausalLM, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as err:
        log.error("TRL is not importable (%s); carry its wheels (see benchmarks/trl_grpo.py)", err)
        raise SystemExit(2) from err
    from hybridflow.models.presets import preset_config

    on_cpu = args.device == "cpu"
    torch.manual_seed(0)
    cfg = preset_config(args.preset)
    with torch.device("cpu" if on_cpu else "cuda"):  # a 7B random init on the host takes minutes
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype))
    peft_config = None
    if args.lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha or args.lora_rank, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    tokenizer = word_tokenizer(cfg.vocab_size)
    rng = np.random.default_rng(0)
    total = args.steps + 1
    prompts = [" ".join(f"t{i}" for i in rng.integers(min(100, cfg.vocab_size // 2), cfg.vocab_size,
                                                          args.prompt_len))
               for _ in range(args.prompts * total)]
    dataset = datasets.Dataset.from_dict({"prompt": prompts})
    rows = args.prompts * args.n
    if rows % args.ga:
        raise ValueError(f"--ga={args.ga} must divide prompts*n={rows}")
    gen_time = [0.0]
    orig_generate = model.generate

    def timed_generate(*a: Any, **kw: Any) -> Any:
        if not on_cpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = orig_generate(*a, **kw)
        if not on_cpu:
            torch.cuda.synchronize()
        gen_time[0] += time.perf_counter() - t0
        return out

    model.generate = timed_generate
    generation: dict[str, Any] = dict(use_vllm=False, generation_kwargs={"min_new_tokens": args.response_len})
    if args.vllm == "colocate":
        import os

        # vLLM reads weights from disk; colocate mode joins torch.distributed (one rank here)
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                           ("MASTER_PORT", "29517")):
            os.environ.setdefault(key, value)
        path = Path("/tmp/trl_vllm_model")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        model = str(path)
        generation = dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=args.vllm_memory,
                          generation_kwargs={"min_tokens": args.response_len},
                          model_init_kwargs={"dtype": getattr(torch, args.dtype)})
    conf = GRPOConfig(
        output_dir="/tmp/trl_bench", per_device_train_batch_size=rows // args.ga,
        gradient_accumulation_steps=args.ga, num_generations=args.n, max_completion_length=args.response_len,
        temperature=1.0, beta=0.0, **generation,
        bf16=not on_cpu, use_cpu=on_cpu, learning_rate=1e-6, max_steps=total, logging_steps=1, save_strategy="no",
        report_to="none", seed=0, shuffle_dataset=False, dataloader_num_workers=0,
    )
    ends: list[float] = []
    gens: list[float] = []
    peaks: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, *a: Any, **kw: Any) -> None:
            if not on_cpu:
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_allocated() / 2**30)
                torch.cuda.reset_peak_memory_stats()
            ends.append(time.perf_counter())
            gens.append(gen_time[0])
            log.info("TRL step %d done at %.2fs (generate so far %.2fs)", len(ends), ends[-1] - start, gen_time[0])

    trainer = GRPOTrainer(model=model, reward_funcs=length_mod5, args=conf, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepClock()], peft_config=peft_config)
    trained = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total_params = sum(p.numel() for p in trainer.model.parameters())
    start = time.perf_counter()
    trainer.train()
    step_s = [b - a for a, b in zip(ends, ends[1:])]
    gen_s = [b - a for a, b in zip(gens, gens[1:])]
    res = {"preset": args.preset, "trl": trl.__version__, "torch": torch.__version__, "args": vars(args),
           "first_step_s": ends[0] - start if ends else None, "step_s": step_s, "gen_s": gen_s,
           "median_step_s": float(np.median(step_s)) if step_s else None,
           "median_gen_s": float(np.median(gen_s)) if gen_s and args.vllm == "off" else None, "peak_memory_gb": peaks,
           "trainable_params": trained, "total_params": total_params,
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    return res


if __name__ == "__main__":
    main()
