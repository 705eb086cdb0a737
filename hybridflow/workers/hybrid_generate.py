"""Generation on a trained engine's own parameters (hybrid engine): the rollout engine beside a `TrainEngine`, and
the train → generate → train switch around one `generate` — shared by the PPO actor and the DPO policy (whose
validation measures greedy task accuracy)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.config import Config
from hybridflow.protocol import DataProto, keys
from hybridflow.rollout import build_rollout

if TYPE_CHECKING:
    from hybridflow.engine import TrainEngine
    from hybridflow.rollout import RolloutEngine


def build_engine_rollout(cfg: Config, engine: TrainEngine, tokenizer: Any, device: torch.device) -> RolloutEngine:
    """A rollout engine over `engine`'s module (`rollout.*`, `data.max_prompt_length` / `max_response_length`)."""

    return build_rollout(
        engine.module, cfg.rollout, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        max_prompt_length=cfg.data.max_prompt_length, max_response_length=cfg.data.max_response_length,
        device=device, tokenizer=tokenizer, chat_template=cfg.data.chat_template,
    )


def generate_on(engine: TrainEngine, rollout: RolloutEngine, prompts: DataProto) -> DataProto:
    """Train → generate → train on the same weights; `timing/switch` is the mode switch both ways (the rollout
    engine itself releases its KV cache at the end of `generate` when `rollout.free_cache_engine`)."""
    t0 = time.perf_counter()
    engine.to_mode("generate")
    rollout.sync_weights()
    t1 = time.perf_counter()
    out = rollout.generate(seeds_to_meta(prompts))
    t2 = time.perf_counter()
    engine.to_mode("train")
    t3 = time.perf_counter()
    out = out.to("cpu")
    out.meta_info.pop(keys.SEEDS, None)  # per-row data, not metadata (the driver sent them as the `seeds` column)
    engine_metrics = out.meta_info.get("metrics") or {}  # cache alloc, graph capture, decode steps
    out.meta_info["metrics"] = {**engine_metrics, "timing/switch": (t1 - t0) + (t3 - t2), "timing/generate": t2 - t1}
    return out


def seeds_to_meta(prompts: DataProto) -> DataProto:
    """The driver sends per-prompt seeds as a `seeds` column (so they are split with the rows); the rollout
    engine takes them from meta_info."""
    if keys.SEEDS not in prompts.batch:
        return prompts
    batch = {k: v for k, v in prompts.batch.items() if k != keys.SEEDS}
    meta = {**prompts.meta_info, keys.SEEDS: prompts.batch[keys.SEEDS].tolist()}
    return DataProto(batch=batch, non_tensor_batch=prompts.non_tensor_batch, meta_info=meta)
