"""Per-step metrics on the driver: the one reduction of per-rank worker metrics, and data metrics from the batch
(rewards, advantages, values, lengths, throughput)."""

from __future__ import annotations

import numpy as np
import torch

from hybridflow.algorithms import masked_mean
from hybridflow.protocol import DataProto, keys


def reduce_metrics(per_rank: list[dict[str, float]] | dict[str, float], prefix: str = "") -> dict[str, float]:
    """Average each key over the ranks that reported it (a single dict: one rank, as collected without concat).
    With `prefix`, a bare key (no `/`, as the engine reports `loss`) is namespaced `<prefix>/<key>`."""
    if isinstance(per_rank, dict):
        per_rank = [per_rank]
    keys = sorted({k for m in per_rank for k in m})
    means = {k: float(np.mean([m[k] for m in per_rank if k in m])) for k in keys}
    return {(f"{prefix}/{k}" if prefix and "/" not in k else k): v for k, v in means.items()}


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    v = values.float()
    return {f"{prefix}/mean": float(v.mean()), f"{prefix}/max": float(v.max()), f"{prefix}/min": float(v.min())}


def _masked_stats(prefix: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    valid = values[mask.bool()]
    out = _stats(prefix, valid)
    if out:
        out[f"{prefix}/mean"] = float(masked_mean(values.float(), mask.float()))
    return out


def compute_data_metrics(batch: DataProto, max_response_length: int) -> dict[str, float]:
    b = batch.batch
    mask = b[keys.RESPONSE_MASK].bool()
    resp_len = mask.sum(-1).float()
    out: dict[str, float] = {}
    if keys.TOKEN_LEVEL_SCORES in b:
        out |= _stats("reward/score", b[keys.TOKEN_LEVEL_SCORES].sum(-1))
    if keys.TOKEN_LEVEL_REWARDS in b and b[keys.TOKEN_LEVEL_REWARDS] is not b.get(keys.TOKEN_LEVEL_SCORES):
        out |= _stats("reward/kl_penalized", b[keys.TOKEN_LEVEL_REWARDS].sum(-1))  # a value of its own: KL in reward
    if keys.ADVANTAGES in b:
        out |= _masked_stats("adv", b[keys.ADVANTAGES], mask)
    if keys.RETURNS in b:
        out |= _masked_stats(keys.RETURNS, b[keys.RETURNS], mask)
    if keys.VALUES in b:
        out |= _masked_stats("critic/values", b[keys.VALUES], mask)
    out |= _stats("response_length", resp_len)
    out["response_length/clip_ratio"] = float((resp_len >= max_response_length).float().mean())
    if keys.ATTENTION_MASK in b and keys.PROMPTS in b:
        prompt_len = b[keys.ATTENTION_MASK][:, : b[keys.PROMPTS].shape[1]].sum(-1).float()
        out["prompt_length/mean"] = float(prompt_len.mean())
    return out


def per_source_scores(scores: np.ndarray, sources: np.ndarray, prefix: str) -> dict[str, float]:
    """`<prefix>/<data_source>` = mean score of that source's rows."""
    out = {}
    for src in sorted(set(sources.tolist())):
        sel = sources == src
        out[f"{prefix}/{src}"] = float(np.mean(scores[sel]))
    return out


def throughput_metrics(batch: DataProto, step_time: float, world_size: int) -> dict[str, float]:
    tokens = int(batch.batch[keys.ATTENTION_MASK].sum())
    return {"perf/total_num_tokens": float(tokens), "perf/throughput": tokens / max(step_time, 1e-9) / world_size}


def memory_metrics() -> dict[str, float]:
    import psutil

    out = {"perf/cpu_memory_gb": psutil.Process().memory_info().rss / 2**30}
    if torch.cuda.is_available():
        out["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    return out
