"""The planner's inputs read from a `Config`: each engine through the same `EngineSpec` the workers build
(workers/engine_specs.py), so the planner reads exactly the keys the run reads, and which stages a step runs
(config/resolved.py).

Sequences are counted at their maximum length (prompt + response): an upper bound of the tokens of a micro-batch
unless `rollout.ignore_eos`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hybridflow.config import Config
from hybridflow.config.auto_sizes import auto_keys, gpu_values, model_shape
from hybridflow.config.loader import load_config, merge_sources
from hybridflow.config.resolved import resolve
from hybridflow.engine.optim import optimizer_state_bytes_per_param
from hybridflow.engine.spec import EngineSpec, MicroBatching
from hybridflow.planning.memory import ADAM_BYTES, EngineSettings, RolloutSettings
from hybridflow.planning.model_shape import ModelShape, lora_targets, read_config_json, read_shape
from hybridflow.workers.engine_specs import REF_LOGPROB_CHUNK, actor_spec, critic_spec, ref_spec, teacher_spec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class PlanInputs:
    engines: dict[str, EngineSettings]
    rollout: RolloutSettings
    stages: list[str]  # the stages a step runs, in order
    world: int
    samples_per_gpu: int


def _tokens(batching: MicroBatching, seq: int, per_gpu: int) -> int:
    samples = per_gpu if batching.dynamic else min(batching.size, per_gpu)
    tokens = samples * seq
    return min(tokens, max(batching.max_tokens, seq)) if batching.dynamic else tokens


def engine_settings(role: str, spec: EngineSpec, shape: ModelShape, world: int, seq: int, mini_per_gpu: int,
                    rows_per_gpu: int, chunk: int, compute_bytes: int) -> EngineSettings:
    f = spec.fsdp
    lora = spec.lora.rank if spec.uses_lora else 0
    train = spec.train_batching
    return EngineSettings(
        role=role, shape=shape, head=spec.head, trainable=spec.trainable, lora_rank=lora,
        lora_targets=lora_targets(spec.model) if lora else (), master_bytes=DTYPE_BYTES[f.param_dtype],
        compute_bytes=compute_bytes, reduce_bytes=DTYPE_BYTES[f.reduce_dtype], optimizer_offload=f.optimizer_offload,
        state_bytes=optimizer_state_bytes_per_param(spec.optimizer.optim.optimizer) if spec.optimizer else ADAM_BYTES,
        param_offload=f.param_offload, reshard_after_forward=f.reshard_after_forward,
        defer_grad_sync=f.defer_grad_sync,
        checkpointing=spec.trainable and spec.model.enable_gradient_checkpointing,
        compiled=spec.model.use_torch_compile in ("auto", True),
        train_tokens=_tokens(train, seq, mini_per_gpu) if train is not None else 0,
        infer_tokens=_tokens(spec.infer_batching, seq, rows_per_gpu), logprob_chunk=chunk, world=world)


def plan_inputs(cfg: Config, world: int | None = None) -> PlanInputs:
    """Everything the planner needs from `cfg` on `world` GPUs (default: the config's nodes × GPUs per node)."""
    res = resolve(cfg)
    world = world or res.world_size
    n, seq = cfg.rollout.n, cfg.data.max_prompt_length + cfg.data.max_response_length
    rows = max(1, cfg.data.train_batch_size * n // world)
    compute = 4 if cfg.model.dtype == "float32" else 2
    shape = read_shape(cfg.model)
    mini = max(1, cfg.actor.ppo_mini_batch_size * n // world)
    engines = {"actor": engine_settings("actor", actor_spec(cfg), shape, world, seq, mini, rows,
                                        cfg.actor.logprob_chunk_size, compute)}
    stages = ["generate"]
    if res.recompute_old_log_prob:
        stages.append("old_log_prob")
    if res.use_reference:
        stages.append("ref")
        if not cfg.model.lora.enabled:  # LoRA: the actor with its adapters off is the reference
            engines["ref"] = engine_settings("ref", ref_spec(cfg), shape, world, seq, mini, rows,
                                             REF_LOGPROB_CHUNK, compute)
    if res.use_teacher:  # on-policy distillation: a frozen engine of the teacher's own shape, scored as the reference
        spec = teacher_spec(cfg)
        engines["teacher"] = engine_settings("teacher", spec, read_shape(spec.model), world, seq, mini, rows,
                                             REF_LOGPROB_CHUNK, compute)
        stages.append("teacher")
    if res.use_critic:
        c_shape = read_shape(cfg.model, cfg.critic.model_path)
        c_mini = max(1, cfg.critic.ppo_mini_batch_size * n // world)
        engines["critic"] = engine_settings("critic", critic_spec(cfg), c_shape, world, seq, c_mini, rows,
                                            0, compute)
        stages += ["values", "update_critic"]
    stages.append("update_actor")
    r = cfg.rollout
    rollout = RolloutSettings(
        prompt_len=cfg.data.max_prompt_length, response_len=cfg.data.max_response_length, rows_per_gpu=rows,
        prompts_per_gpu=max(1, cfg.data.train_batch_size // world), max_num_seqs=r.max_num_seqs,
        kv_cache_tokens=r.kv_cache_tokens, gpu_memory_utilization=r.gpu_memory_utilization,
        max_num_batched_tokens=r.max_num_batched_tokens, free_cache_engine=bool(r.free_cache_engine),
        tp=r.tensor_model_parallel_size, quantization=r.quantization)
    return PlanInputs(engines=engines, rollout=rollout, stages=stages, world=world, samples_per_gpu=rows)


def with_engine(inputs: PlanInputs, role: str, **changes: object) -> PlanInputs:
    """`inputs` with `changes` applied to one engine's settings (the planner's search)."""
    engines = dict(inputs.engines)
    engines[role] = dataclasses.replace(engines[role], **changes)
    return dataclasses.replace(inputs, engines=engines)


def load_for_gpu(files: list[str], overrides: list[str], gpu_gib: float, gpus: int | None = None) -> Config:
    """The config as a run on `gpus` GPUs of `gpu_gib` would resolve it: every `auto` size takes its GPU value
    (config/auto_sizes.py) for that memory, whatever GPU (or none) this process sees."""
    if gpus:
        overrides = [*overrides, "trainer.nnodes=1", f"trainer.n_gpus_per_node={gpus}"]
    merged = merge_sources(files, overrides)
    for path in (merged["model"].get("path"), merged.get("critic", {}).get("model_path"),
                 merged.get("teacher", {}).get("model_path")):
        if path:
            read_config_json(str(path))  # a missing model names the key before anything reads it
    keys = auto_keys(merged)
    if keys:
        values = gpu_values(merged, model_shape(merged), gpu_gib)
        overrides = [*overrides, *(f"{s}.{k}={str(values[(s, k)]).lower()}" for s, k in keys)]
    return load_config(files, overrides, validate=False)
