"""`auto` sizes: micro-batches, the log-prob chunk and whether the KV cache is freed, chosen from the model's shape,
the sequence lengths and the GPU's memory when the config is loaded (a config that sets nothing should run
near the settings measured fastest on one H200).

On CPU every `auto` resolves to the value that was the default before (16 / 32 samples, 1,024-token chunks, free the
KV cache): CPU learning tests and their thresholds were measured with those, and micro-batch sizes change float
summation order. On GPU:

- micro-batch TOKENS = `ACTIVATION_TOKENS_PER_GIB` × (GPU GiB × 0.9 − model state GiB − kept KV cache GiB)
  / (layers × hidden), rounded down to a power of two; SAMPLES = tokens / (max prompt + max response length), made a
  divisor of the per-GPU mini-batch. The constant is set so the Qwen2.5-0.5B and 1.5B shapes on one H200 get the
  micro-batches measured fastest there (64 and 32 samples of 512 tokens; docs/benchmarks.md, "Defaults vs tuned settings").
- log-prob passes (no backward) use at least as many samples as before (32).
- `logprob_chunk_size` 4,096 tokens; `rollout.free_cache_engine` false (keep the KV cache and CUDA graphs between
  steps) unless the model state takes over 40% of the GPU.

An explicit number in the config always wins. If an auto-chosen training micro-batch runs out of memory the engine
halves it once and retries the mini-batch with a warning (`engine/train_engine.py`, one rank only).
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

AUTO = "auto"
# Training activations, tokens per GiB per (layer x hidden) unit: ~134 bytes per unit and token (bf16, no
# activation checkpointing). Calibrated: 0.5B on an H200 -> 32,768 tokens; 1.5B -> 16,384 (the tuned sizes).
ACTIVATION_TOKENS_PER_GIB = 8.0e6
CPU_VALUES = {
    ("actor", "ppo_micro_batch_size_per_gpu"): 16,
    ("actor", "log_prob_micro_batch_size_per_gpu"): 32,
    ("ref", "log_prob_micro_batch_size_per_gpu"): 32,
    ("critic", "ppo_micro_batch_size_per_gpu"): 16,
    ("actor", "logprob_chunk_size"): 1024,
    ("rollout", "free_cache_engine"): True,
}
GPU_CHUNK = 4096
KEEP_CACHE_MAX_STATE_FRACTION = 0.4


def auto_keys(merged: dict[str, Any]) -> list[tuple[str, str]]:
    return [(sec, key) for sec, key in CPU_VALUES if merged.get(sec, {}).get(key) == AUTO]


def resolve_auto_sizes(merged: dict[str, Any]) -> dict[str, Any]:
    """`merged` (the config dict before it is typed) with every `auto` of `CPU_VALUES`' keys replaced by a number.
    Returns a new dict; logs what was chosen on GPU."""
    keys = auto_keys(merged)
    if not keys:
        return merged
    out = {sec: dict(v) if isinstance(v, dict) else v for sec, v in merged.items()}
    gpu = _gpu_memory_gib(merged)
    if gpu is None:
        for sec, key in keys:
            out[sec][key] = CPU_VALUES[(sec, key)]
        return out
    shape = model_shape(merged)
    values = gpu_values(merged, shape, gpu)
    for sec, key in keys:
        out[sec][key] = values[(sec, key)]
    logger.info("auto sizes for a %.0f GiB GPU and %s: %s", gpu, shape,
                ", ".join(f"{s}.{k}={values[(s, k)]}" for s, k in keys))
    return out


def gpu_values(merged: dict[str, Any], shape: dict[str, int], gpu_gib: float) -> dict[tuple[str, str], Any]:
    """The GPU choices for a model `shape` (layers, hidden, params, kv_heads, head_dim) on a `gpu_gib` GPU."""
    data, trainer = merged["data"], merged["trainer"]
    world = max(1, int(trainer.get("n_gpus_per_node", 1)) * int(trainer.get("nnodes", 1)))
    seq = int(data["max_prompt_length"]) + int(data["max_response_length"])
    lora = int(merged.get("model", {}).get("lora", {}).get("rank", 0) or 0) > 0
    # fp32 master + grad + Adam (16 B/param), sharded over ranks; LoRA: frozen bf16 base only
    state_gib = shape["params"] * (2 if lora else 16 / world) / 2**30
    keep_cache = state_gib <= KEEP_CACHE_MAX_STATE_FRACTION * gpu_gib
    slots = int(merged["rollout"].get("max_num_seqs") or 0) or int(data["train_batch_size"]) * int(merged["rollout"]["n"])
    kv_gib = (slots * seq * shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * 2 / 2**30) if keep_cache else 0.0
    budget = max(gpu_gib * 0.9 - state_gib - kv_gib, 1.0)
    tokens = _pow2_floor(ACTIVATION_TOKENS_PER_GIB * budget / (shape["layers"] * shape["hidden"]))
    out: dict[tuple[str, str], Any] = {}
    for role in ("actor", "critic"):
        sec = merged.get(role, {})
        per_gpu = max(1, int(sec.get("ppo_mini_batch_size", 1)) * int(merged["rollout"]["n"]) // world)
        out[(role, "ppo_micro_batch_size_per_gpu")] = _largest_divisor_at_most(per_gpu, max(1, tokens // seq))
    train = out[("actor", "ppo_micro_batch_size_per_gpu")]
    out[("actor", "log_prob_micro_batch_size_per_gpu")] = max(32, train)
    out[("ref", "log_prob_micro_batch_size_per_gpu")] = max(32, train)
    out[("actor", "logprob_chunk_size")] = GPU_CHUNK
    out[("rollout", "free_cache_engine")] = not keep_cache
    return out


def _gpu_memory_gib(merged: dict[str, Any]) -> float | None:
    """Total memory of the GPU this run trains on; None for a CPU run (or a driver that cannot see a GPU)."""
    device = merged.get("trainer", {}).get("device", "auto")
    if device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        if device == "cuda":
            logger.warning("trainer.device=cuda but this process sees no GPU: auto micro-batch sizes use the CPU "
                           "values; set actor.ppo_micro_batch_size_per_gpu etc. explicitly for the workers' GPUs")
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def model_shape(merged: dict[str, Any]) -> dict[str, int]:
    model = merged.get("model", {})
    override = dict(model.get("override_config") or {})
    if model.get("path"):
        # a Hugging Face id in the local cache reads its snapshot's config
        from hybridflow.models.loader import resolve_path

        cfg = json.loads((resolve_path(str(model["path"])) / "config.json").read_text())
        cfg.update(override)
    else:
        from hybridflow.models.presets import preset_config

        cfg = preset_config(str(model.get("preset", "tiny")), **override).to_dict()
    cfg = cfg.get("text_config", cfg)
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads = int(cfg.get("num_attention_heads", 1))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg.get("intermediate_size", 4 * hidden))
    vocab = int(cfg.get("vocab_size", 0))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    params = layers * (hidden * head_dim * (heads * 2 + kv_heads * 2) + 3 * hidden * inter) + 2 * vocab * hidden
    return {"layers": layers, "hidden": hidden, "params": params, "kv_heads": kv_heads, "head_dim": head_dim}


def _pow2_floor(x: float) -> int:
    n = 1
    while n * 2 <= x:
        n *= 2
    return n


def _largest_divisor_at_most(n: int, cap: int) -> int:
    for d in range(min(n, cap), 0, -1):
        if n % d == 0:
            return d
    return 1
