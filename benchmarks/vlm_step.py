"""One GRPO step of a vision-language model: generation (our engine vs the HF generate fallback), log-probs, update.

Random-init Qwen2.5-VL-3B shape (language model: hidden 2048, 36 layers, 16 heads, 2 kv heads, intermediate 11008,
vocab 151936, tied embeddings; vision tower: depth 32, hidden 1280, 16 heads, intermediate 3420, patch 14, out
hidden 2048), built as the `tiny-vl` preset with these overrides (no download). Prompts: a synthetic colour image
(`data/colour_task.py`'s squares, scaled to --image-side pixels: (side/28)^2 image tokens) and a question, rendered
by `data/vision.py` with a Qwen2-VL image processor of 14-pixel patches. The step: `generate` (n samples per
prompt, ignore_eos, our engine), the actor's log-probs of the samples (old_log_prob), GRPO advantages of a
synthetic reward ((sum of response ids mod 5) / 4), one PPO-clip update; then the same prompts through the HF
generate fallback (`rollout.name=hf`) for its generation time. bf16 compute over fp32 masters (one rank, FSDP2); the KV cache and
CUDA graphs are kept between steps (rollout.free_cache_engine=false), so the timed step replays captured graphs.
One H200 (~3 min):  PYTHONPATH=. python -m benchmarks.vlm_step --out $OUT/vlm_step.json
CPU smoke:          PYTHONPATH=. python -m benchmarks.vlm_step --smoke --out /tmp/vlm_step.json
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from benchmarks import harness
from benchmarks.rollout import timed
from hybridflow.algorithms.advantages import compute_advantage
from hybridflow.algorithms.policy_loss import vanilla_policy_loss
from hybridflow.config import load_config
from hybridflow.data import collate_rl
from hybridflow.data.colour_task import draw, layouts
from hybridflow.data.vision import VisionPrompts
from hybridflow.engine import HeadRequest, TrainEngine
from hybridflow.engine.update import UpdatePlan, train_update
from hybridflow.models.tiny_vl import tiny_vl_tokenizer
from hybridflow.protocol import DataProto, keys
from hybridflow.rollout import RolloutEngine
from hybridflow.workers.engine_specs import actor_spec

log = logging.getLogger("bench.vlm_step")
PATCH = 14
SHAPES = {
    "qwen2.5-vl-3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                          intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
                          max_position_embeddings=32768,
                          vision_config=dict(depth=32, hidden_size=1280, num_heads=16, intermediate_size=3420,
                                             patch_size=PATCH, window_size=112, fullatt_block_indexes=[7, 15, 23, 31],
                                             out_hidden_size=2048, tokens_per_second=2)),
    "tiny": dict(vision_config=dict(patch_size=PATCH, window_size=112)),  # the preset, with 14-pixel patches
}


def build_actor(args: argparse.Namespace) -> tuple[TrainEngine, Any]:
    rows = args.prompts * args.n
    cfg = load_config([], ["model.preset=tiny-vl", f"data.max_prompt_length={args.prompt_len}",
                           f"data.max_response_length={args.new_tokens}", "rollout.ignore_eos=true",
                           f"rollout.n={args.n}", f"rollout.max_num_seqs={rows}", "rollout.free_cache_engine=false",
                           f"actor.ppo_micro_batch_size_per_gpu={args.micro}",
                           f"actor.log_prob_micro_batch_size_per_gpu={args.micro}",
                           f"model.enable_gradient_checkpointing={str(args.device != 'cpu').lower()}",
                           "actor.optim.lr=1e-6", *args.override])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, override_config=SHAPES[args.shape]))
    return TrainEngine(actor_spec(cfg), device=args.device), cfg


def prompts_for(args: argparse.Namespace) -> DataProto:
    """--prompts colour-square images scaled to --image-side pixels, each with its question, left-padded."""
    tok = tiny_vl_tokenizer()
    side = args.image_side
    proc = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=2, temporal_patch_size=2,
                                    min_pixels=side * side, max_pixels=side * side)
    render = VisionPrompts(tok, proc)
    items = []
    for (layout, colour), _ in zip(layouts(seed=1), range(args.prompts)):
        img = Image.open(io.BytesIO(draw(layout))).resize((side, side), Image.NEAREST)
        text, mm = render(tok.apply_chat_template([{"role": "user", "content": f"<image>How many {colour}?"}],
                                                  tokenize=False, add_generation_prompt=True), [img])
        items.append({keys.INPUT_IDS: torch.tensor(tok.encode(text, add_special_tokens=False)),
                      keys.MULTI_MODAL_INPUTS: mm, keys.UID: f"p{len(items)}"})
    width = max(len(i[keys.INPUT_IDS]) for i in items)
    if width > args.prompt_len:
        raise ValueError(f"--prompt-len {args.prompt_len} < {width} prompt tokens at --image-side {side}")
    return collate_rl(items, pad_token_id=tok.pad_token_id)


def grpo_loss(outputs: dict[str, torch.Tensor], mb: DataProto, norm: dict[str, torch.Tensor]):
    b = mb.batch
    return vanilla_policy_loss(b[keys.OLD_LOG_PROBS], outputs["log_probs"], b[keys.ADVANTAGES], b[keys.RESPONSE_MASK],
                               global_normalizer=norm["token-mean"])


def grpo_step(actor: TrainEngine, rollout: RolloutEngine, prompts: DataProto, dev: torch.device) -> dict[str, float]:
    """Stage timings (s) of one step: generate, old_log_prob, adv, update_actor, step."""
    t0 = time.perf_counter()
    rollout.sync_weights()
    out, t_gen = timed(lambda: rollout.generate(prompts), dev)
    head = HeadRequest("lm", 1.0)
    old, t_old = timed(lambda: actor.infer(out, head)["log_probs"], dev)
    b = out.batch
    scores = (b[keys.RESPONSES] * b[keys.RESPONSE_MASK]).sum(-1).remainder(5).float() / 4
    rewards = torch.zeros_like(b[keys.RESPONSE_MASK], dtype=torch.float32)
    rewards[:, -1] = scores
    (adv, _), t_adv = timed(lambda: compute_advantage("grpo", token_level_rewards=rewards,
                                                      response_mask=b[keys.RESPONSE_MASK],
                                                      index=out.non_tensor_batch[keys.UID]), dev)
    out = out.union(DataProto.from_dict({keys.OLD_LOG_PROBS: old, keys.ADVANTAGES: adv}))
    metrics, t_upd = timed(lambda: train_update(actor, out, grpo_loss, head, UpdatePlan(len(out))), dev)
    m = out.meta_info.get("metrics", {})
    return {"timing/gen": t_gen, "timing/rollout_vision": m.get("timing/rollout_vision", 0.0),
            "timing/rollout_graph_capture": m.get("timing/rollout_graph_capture", 0.0), "timing/old_log_prob": t_old,
            "timing/adv": t_adv, "timing/update_actor": t_upd, "timing/step": time.perf_counter() - t0,
            "actor/grad_norm": float(metrics.get("grad_norm", float("nan"))),
            "response_tokens": float(b[keys.RESPONSE_MASK].sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-vl-3b")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--image-side", type=int, default=224, help="pixels; (side / 28)^2 image tokens")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--micro", type=int, default=16, help="rows per log-prob / update micro-batch")
    ap.add_argument("--steps", type=int, default=1, help="timed steps after one warm-up step (compile, graphs)")
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="time the HF fallback too")
    harness.add_override_arg(ap, "extra a.b=c config override; repeatable")
    ap.add_argument("--smoke", action="store_true", help="CPU, the tiny preset, a few tokens")
    ap.add_argument("--out", default="vlm_step.json")
    args = ap.parse_args()
    harness.apply_smoke(args, dict(device="cpu", shape="tiny", prompts=3, n=2, image_side=56, prompt_len=48,
                                   new_tokens=6, micro=2))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    actor, cfg = build_actor(args)
    tok = tiny_vl_tokenizer()
    prompts = prompts_for(args)
    common = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_prompt_length=args.prompt_len,
                  max_response_length=args.new_tokens)
    result: dict[str, Any] = {"env": harness.environment(dev.type == "cuda"), "shape": args.shape,
                              "prompts": args.prompts, "n": args.n, "new_tokens": args.new_tokens,
                              "prompt_tokens": int(prompts.batch[keys.ATTENTION_MASK].sum(-1).max()),
                              "image_tokens": int((prompts.batch[keys.INPUT_IDS] == actor.module.config.image_token_id)
                                                  .sum(-1).max())}
    ours = RolloutEngine(actor.module, cfg.rollout, **common)
    assert not ours.uses_hf_fallback, "the vision-language model fell back to HF generate"
    warm = grpo_step(actor, ours, prompts, dev)
    log.info("warm-up step (compile, CUDA graphs): %s", warm)
    steps = [grpo_step(actor, ours, prompts, dev) for _ in range(args.steps)]
    result |= {"warmup": warm, "steps": steps, "ours": harness.summarize(steps)}
    if dev.type == "cuda":
        result["peak_memory_gb"] = torch.cuda.max_memory_allocated(dev) / 2**30
    ours.release_cache()
    harness.write_json(args.out, result)
    if args.hf:
        hf = RolloutEngine(actor.module, dataclasses.replace(cfg.rollout, name="hf"), **common)
        out, t = timed(lambda: hf.generate(prompts), dev)
        rows = args.prompts * args.n
        result["hf_gen_s"] = t
        result["speedup_gen"] = t / result["ours"]["timing/gen"]
        result["hf_response_tokens"] = float(out.batch[keys.RESPONSE_MASK].sum())
        log.info("HF generate: %.2fs for %d rows (ours %.2fs)", t, rows, result["ours"]["timing/gen"])
    harness.write_json(args.out, result)
    harness.emit_json_line({k: v for k, v in result.items() if k not in ("env", "steps", "warmup")}, None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
