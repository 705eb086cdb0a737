"""How long a checkpoint save blocks the training loop, async_save on vs off.

    .venv/bin/python benchmarks/checkpoint.py --state tiny --device cpu
    .venv/bin/python benchmarks/checkpoint.py --state 0.5b --device cuda --optimizer

`tiny` is the tiny preset model + AdamW state; `0.5b` is a random state dict with the Qwen2.5-0.5B parameter
shapes (bf16 weights; `--optimizer` adds fp32 exp_avg/exp_avg_sq like AdamW). Each save is followed by a fake
"training step" of `--step-s` seconds so an async write can overlap it. Prints one JSON line per mode.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from hybridflow.checkpoint import CheckpointManager


def _qwen05b_shapes() -> dict[str, tuple[int, ...]]:
    v, h, i, n_layers, kv = 151936, 896, 4864, 24, 128
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for layer in range(n_layers):
        p = f"model.layers.{layer}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
        })
    return shapes


def build_state(kind: str, device: str, optimizer: bool) -> dict:
    if kind == "tiny":
        from transformers import Qwen2ForCausalLM

        from hybridflow.models.presets import preset_config
        cfg = preset_config("tiny")
        model = Qwen2ForCausalLM(cfg).to(device)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.randint(0, cfg.vocab_size, (2, 16), device=device)).logits.sum().backward()
        opt.step()
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}
    shapes = _qwen05b_shapes()
    g = torch.Generator(device=device).manual_seed(0)
    model = {k: torch.randn(s, generator=g, device=device, dtype=torch.bfloat16) for k, s in shapes.items()}
    state: dict = {"model": model}
    if optimizer:
        state["optimizer"] = {"state": {k: {"exp_avg": torch.zeros(s, device=device),
                                            "exp_avg_sq": torch.zeros(s, device=device)} for k, s in shapes.items()},
                              "param_groups": [{"lr": 1e-6}]}
    return state


def nbytes(state: dict) -> int:
    from hybridflow.checkpoint.flatten import flatten_state
    return sum(t.numel() * t.element_size() for t in flatten_state(state)[0].values())


def run(state: dict, root: Path, async_save: bool, saves: int, step_s: float) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    mgr = CheckpointManager(root, async_save=async_save, keep_last_n=2)
    blocking, loop = [], []
    t_all = time.perf_counter()
    for step in range(1, saves + 1):
        t0 = time.perf_counter()
        mgr.save(step, {"actor": state}, extra={"step": step})
        blocking.append(time.perf_counter() - t0)
        time.sleep(step_s)  # the training step the write may overlap
        loop.append(time.perf_counter() - t0)
    t_wait = time.perf_counter()
    mgr.close()
    tail_wait = time.perf_counter() - t_wait
    total = time.perf_counter() - t_all
    shutil.rmtree(root, ignore_errors=True)
    # save 1 pays buffer allocation (pinned on GPU); report steady state from save 2 on when available
    steady = blocking[1:] or blocking
    return {"async_save": async_save, "saves": saves, "blocking_s_first": round(blocking[0], 4),
            "blocking_s_steady_mean": round(sum(steady) / len(steady), 4),
            "write_s_last": round(mgr._writer.last_duration_s, 4) if async_save else None,
            "final_wait_s": round(tail_wait, 4), "total_s": round(total, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state", choices=("tiny", "0.5b"), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--optimizer", action="store_true", help="0.5b: add fp32 AdamW moments")
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--step-s", type=float, default=None, help="fake training step after each save")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    state = build_state(args.state, args.device, args.optimizer)
    size = nbytes(state)
    step_s = args.step_s if args.step_s is not None else (0.5 if args.state == "tiny" else 5.0)
    root = Path(args.dir or tempfile.mkdtemp(prefix="hf_ckpt_bench_")) / "ckpt"
    for async_save in (False, True):
        res = run(state, root, async_save, args.saves, step_s)
        res.update(state=args.state, device=args.device, state_gb=round(size / 2**30, 3), step_s=step_s)
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
