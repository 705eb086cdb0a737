"""Generation on a trained engine's own parameters (hybrid engine): the rollout engine beside a `TrainEngine`, and
the train → generate → train switch around one `generate` — shared by the PPO actor and the DPO policy (whose
validation measures greedy task accuracy).

Tensor-parallel generation (`rollout.tensor_model_parallel_size` = tp > 1): the driver's data-parallel split over the N
training ranks is kept; the tp consecutive ranks of a generation group (`rollout/reshard.py`) join their chunks into
one batch (a small all-gather of prompts), generate it together with the same prompts and seeds, and each rank returns
only its own rows — so outputs arrive at the driver once each, in order, with no change to dispatch or collection.
At each switch the `Resharder` (built once, like the group and the `TPContext`) cuts this rank's slices out of the
FSDP2 shards and `sync_weights(local=...)` installs them; its byte counts join the step's `rollout/` metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from hybridflow.config import Config
from hybridflow.protocol import DataProto, keys
from hybridflow.rollout import build_rollout
from hybridflow.rollout.reshard import Resharder, tp_group_ranks
from hybridflow.rollout.tensor_parallel import TPContext
from hybridflow.utils.tokenizer_protocol import Tokenizer

if TYPE_CHECKING:
    from hybridflow.engine import TrainEngine
    from hybridflow.rollout import RolloutEngine


@dataclass(frozen=True)
class TPGeneration:
    """What a rank of a tensor-parallel generation group keeps from set-up to the end of the run."""

    group: dist.ProcessGroup
    context: TPContext
    resharder: Resharder


def build_engine_rollout(cfg: Config, engine: TrainEngine, tokenizer: Tokenizer, device: torch.device,
                         group: dist.ProcessGroup | None = None) -> tuple[RolloutEngine, TPGeneration | None]:
    """A rollout engine over `engine`'s module (`rollout.*`, `data.max_prompt_length` / `max_response_length`) and,
    with `group` (this rank's `tp_group`), its tensor-parallel context and resharder."""
    tp = None if group is None else TPContext.for_module(engine.module, group)
    rollout = build_rollout(
        engine.module, cfg.rollout, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        max_prompt_length=cfg.data.max_prompt_length, max_response_length=cfg.data.max_response_length,
        device=device, tokenizer=tokenizer, chat_template=cfg.data.chat_template, tp=tp,
        exact_logprobs=cfg.actor_rollout.exact_logprobs,
    )
    if tp is None:
        return rollout, None
    return rollout, TPGeneration(group, tp, Resharder(engine.module, tp.size, rollout.dtype))


def tp_group(rank: int, world: int, tp: int) -> dist.ProcessGroup | None:
    """This rank's generation group, created once at set-up (every rank creates every group, in the same order, as
    `new_group` requires); None when tp == 1."""
    if tp == 1:
        return None
    mine = None
    for ranks in tp_group_ranks(world, tp):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def join_group_prompts(prompts: DataProto, group: dist.ProcessGroup) -> tuple[DataProto, tuple[int, int]]:
    """The prompt chunks of every rank of `group` in rank order (the batch the whole group generates) and this rank's
    rows [start, stop) in it."""
    parts: list[DataProto | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, prompts, group=group)
    start = sum(len(p) for p in parts[: dist.get_rank(group)])
    return DataProto.concat(parts), (start, start + len(prompts))


def generate_on(engine: TrainEngine, rollout: RolloutEngine, prompts: DataProto,
                tp: TPGeneration | None = None) -> DataProto:
    """Train → generate → train on the same weights; `timing/switch` is the mode switch both ways (the rollout
    engine itself releases its KV cache at the end of `generate` when `rollout.free_cache_engine`). `tp`: this
    rank's tensor-parallel generation group, whose members generate their joined prompts on resharded slices."""
    rows, reshard_metrics = None, {}
    if tp is not None:
        prompts, rows = join_group_prompts(prompts, tp.group)
    t0 = time.perf_counter()
    engine.to_mode("generate")
    if tp is None:
        rollout.sync_weights()
    else:
        local, reshard_metrics = tp.resharder.reshard()
        rollout.sync_weights(local=local)
        del local  # the engine holds what it needs (weights.tp_model_weights)
    t1 = time.perf_counter()
    out = rollout.generate(seeds_to_meta(prompts))
    t2 = time.perf_counter()
    engine.to_mode("train")
    t3 = time.perf_counter()
    out = out.to("cpu")
    if rows is not None:  # this rank's prompts, each with its rollout.n responses (consecutive rows)
        n = len(out) // len(prompts)
        out = out.select_idxs(torch.arange(rows[0] * n, rows[1] * n))  # a copy: a view would ship the whole batch
    out.meta_info.pop(keys.SEEDS, None)  # per-row data, not metadata (the driver sent them as the `seeds` column)
    engine_metrics = out.meta_info.get("metrics") or {}  # cache alloc, graph capture, decode steps
    out.meta_info["metrics"] = {**engine_metrics, **reshard_metrics, "timing/switch": (t1 - t0) + (t3 - t2), "timing/generate": t2 - t1}
    return out


def seeds_to_meta(prompts: DataProto) -> DataProto:
    """The driver sends per-prompt seeds as a `seeds` column (so they are split with the rows); the rollout
    engine takes them from meta_info."""
    if keys.SEEDS not in prompts.batch:
        return prompts
    batch = {k: v for k, v in prompts.batch.items() if k != keys.SEEDS}
    meta = {**prompts.meta_info, keys.SEEDS: prompts.batch[keys.SEEDS].tolist()}
    return DataProto(batch=batch, non_tensor_batch=prompts.non_tensor_batch, meta_info=meta)
