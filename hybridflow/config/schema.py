"""The typed configuration schema: one frozen dataclass per section.

Defaults live in `defaults.yaml` (one place); the dataclasses say what exists and what is allowed.
`__post_init__` checks values and raises `ValueError` naming the key path, the value and the fix. Values that
depend on several sections or on the world size are checked in `validate.py`; derived numbers (per-rank
micro-batches, total steps) are computed in `resolved.py` and never written back here.

Batch sizes, stated once:
  * `data.train_batch_size` — PROMPTS per step, global (all GPUs together).
  * each prompt gets `rollout.n` responses, so a step trains on `train_batch_size * rollout.n` SAMPLES.
  * `actor.ppo_mini_batch_size` / `critic.ppo_mini_batch_size` — PROMPTS per optimizer step, global.
  * `*_micro_batch_size_per_gpu` — SAMPLES per forward/backward on one GPU (ignored when `use_dynamic_bsz`,
    where `*_max_token_len_per_gpu` bounds the TOKENS per micro-batch instead).
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import Any

from hybridflow.config.presets import ALGORITHM_PRESETS

logger = logging.getLogger(__name__)

def _check(cond: bool, key: str, value: Any, fix: str) -> None:
    if not cond:
        raise ValueError(f"{key}={value!r}: {fix}")


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    _check(value in allowed, key, value, f"must be one of {', '.join(map(repr, allowed))}")


def check_path_name(key: str, value: str) -> None:
    """A name that becomes one directory level (runs/<project>/<experiment>): no separators, no `..`."""
    bad = (not value or value in (".", "..") or ".." in value or any(c in value for c in "/\\\0")
           or value != value.strip())
    _check(not bad, key, value, "a name becomes a directory under trainer.run_dir and trainer.default_local_dir, "
           "so it must be one non-empty path segment without '/', '\\' or '..' (e.g. "
           f"{key}=my_run); to write elsewhere set trainer.run_dir / trainer.default_local_dir")


# --------------------------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on every trained module (actor, critic — whose value head stays fully trained — SFT, RM):
    W + (alpha/rank)·B·A through PEFT; the base weights are frozen. rank 0 = off (full fine-tuning)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"  # all-linear = every Linear inside the decoder layers

    def __post_init__(self) -> None:
        _check(self.rank >= 0, "model.lora.rank", self.rank, "must be >= 0 (0 = LoRA off, e.g. 8, 16, 64)")
        _check(self.alpha > 0, "model.lora.alpha", self.alpha, "must be > 0 (the scale is alpha / rank)")
        _check(0 <= self.dropout < 1, "model.lora.dropout", self.dropout, "must be in [0, 1)")
        targets = self.target_modules
        if isinstance(targets, str):
            _check(targets == "all-linear", "model.lora.target_modules", targets,
                   "must be all-linear or a list of module names, e.g. [q_proj, k_proj, v_proj, o_proj]")
        else:
            _check(len(targets) > 0 and all(isinstance(t, str) and t for t in targets), "model.lora.target_modules",
                   targets, "give a non-empty list of module names, e.g. [q_proj, v_proj], or all-linear")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(frozen=True)
class ModelConfig:
    path: str | None  # local HF model directory; None → use `preset`
    preset: str  # random-init preset when no path: tiny | tiny-vl | qwen2.5-0.5b | qwen2.5-1.5b | qwen2.5-7b
    tokenizer_path: str | None  # defaults to `path`, or the built-in tokenizer for presets
    trust_remote_code: bool
    enable_gradient_checkpointing: bool
    use_torch_compile: bool | str  # auto (GPU only) | true | false: torch.compile each decoder layer
    dtype: str  # compute dtype: auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
    override_config: dict[str, Any]  # keys applied to the HF config (e.g. num_hidden_layers) before init
    seed: int  # seed for random init of presets
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        _one_of("model.dtype", self.dtype, ("auto", "float32", "bfloat16", "float16"))
        if self.use_torch_compile not in ("auto", True, False):
            raise ValueError(f"model.use_torch_compile={self.use_torch_compile!r}: must be auto, true or false")


# --------------------------------------------------------------------------------------------------- data
@dataclass(frozen=True)
class DataConfig:
    task: str | None  # built-in synthetic task (e.g. arithmetic); used when train_files is empty
    train_files: list[str]
    val_files: list[str]
    train_size: int  # samples of the built-in task
    val_size: int
    prompt_key: str
    max_prompt_length: int
    max_response_length: int
    truncation: str  # error | left | right | filter
    strict: bool  # malformed rows (and unusable preference pairs: identical, empty chosen, null) raise, not skipped
    allow_missing_ground_truth: bool  # reward functions may get rows without reward_model.ground_truth
    train_batch_size: int  # PROMPTS per step, global
    val_batch_size: int | None  # PROMPTS per validation batch; null = whole val set at once
    shuffle: bool
    seed: int
    drop_last: bool
    use_packed_dataset: bool  # remove padding / pack sequences in training forward passes
    num_workers: int
    prefetch_factor: int | None
    persistent_workers: bool
    chat_template: str | None  # null = tokenizer's template (plain "User: ... Assistant:" if none) | raw | jinja
    chosen_key: str = "chosen"  # preference data (rm, dpo): the preferred response's column (verl / OpenRLHF name)
    rejected_key: str = "rejected"  # the other response's column

    def __post_init__(self) -> None:
        _one_of("data.truncation", self.truncation, ("error", "left", "right", "filter"))
        _check(self.train_batch_size >= 1, "data.train_batch_size", self.train_batch_size, "must be >= 1 (prompts per step)")
        _check(self.max_prompt_length >= 1, "data.max_prompt_length", self.max_prompt_length, "must be >= 1")
        _check(self.max_response_length >= 1, "data.max_response_length", self.max_response_length, "must be >= 1")
        _check(self.num_workers >= 0, "data.num_workers", self.num_workers, "must be >= 0 (0 = load in the main process)")
        if self.num_workers == 0:
            _check(
                not self.persistent_workers, "data.persistent_workers", self.persistent_workers,
                "needs data.num_workers > 0; set data.persistent_workers=false or raise data.num_workers",
            )
        if self.prefetch_factor is not None:
            _check(self.prefetch_factor >= 1, "data.prefetch_factor", self.prefetch_factor, "must be >= 1 or null")
        _check(
            bool(self.task) or bool(self.train_files), "data.train_files", self.train_files,
            "give parquet files (data.train_files=[a.parquet]) or a built-in task (data.task=arithmetic)",
        )


# --------------------------------------------------------------------------------------------------- optim / fsdp
OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_4bit", "adamw_bf16_sr")  # optim.optimizer


@dataclass(frozen=True)
class OptimConfig:
    lr: float
    weight_decay: float
    betas: list[float]
    eps: float
    lr_warmup_steps: int  # -1 → use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float
    lr_scheduler: str  # constant | cosine
    min_lr_ratio: float  # cosine floor as a fraction of lr
    # adamw (torch, fp32 moments) | adamw_8bit | adamw_4bit (torchao, block-quantized moments) | adamw_bf16_sr
    # (torchao, bf16 master weights and moments, stochastic rounding: needs fsdp.param_dtype=bfloat16)
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        _check(self.lr > 0, "optim.lr", self.lr, "must be > 0")
        _one_of("optim.optimizer", self.optimizer, OPTIMIZERS)
        _one_of("optim.lr_scheduler", self.lr_scheduler, ("constant", "cosine"))
        _check(len(self.betas) == 2, "optim.betas", self.betas, "give two numbers, e.g. [0.9, 0.999]")
        _check(0.0 <= self.lr_warmup_steps_ratio <= 1.0, "optim.lr_warmup_steps_ratio", self.lr_warmup_steps_ratio,
               "must be in [0, 1]")


@dataclass(frozen=True)
class FSDPConfig:
    param_offload: bool  # keep parameters on CPU between uses
    # false | true: Adam state parked on the CPU between updates, the step on the device (verl) | cpu_step: fp32
    # master weights and Adam state live on the CPU and the step runs there (engine/host_optim.py)
    optimizer_offload: bool | str
    reshard_after_forward: bool
    param_dtype: str  # master weights dtype: float32 | bfloat16
    reduce_dtype: str  # gradient reduction dtype
    # reduce gradients once per mini-batch, not per micro-batch: auto (one rank) | true (N ranks too) | false
    defer_grad_sync: bool | str = "auto"

    def __post_init__(self) -> None:
        _one_of("fsdp.param_dtype", self.param_dtype, ("float32", "bfloat16"))
        _one_of("fsdp.reduce_dtype", self.reduce_dtype, ("float32", "bfloat16"))
        _check(self.defer_grad_sync in ("auto", True, False), "fsdp.defer_grad_sync", self.defer_grad_sync,
               "must be auto, true or false")
        _check(self.optimizer_offload in (True, False, "cpu_step"), "fsdp.optimizer_offload", self.optimizer_offload,
               "must be true, false or cpu_step")

    @property
    def cpu_step(self) -> bool:
        return self.optimizer_offload == "cpu_step"


def _check_optimizer_fits(section: str, optim: OptimConfig, fsdp: FSDPConfig) -> None:
    if optim.optimizer == "adamw":
        return
    _check(not fsdp.cpu_step, f"{section}.fsdp.optimizer_offload", fsdp.optimizer_offload,
           f"cpu_step runs torch's AdamW on the host; with {section}.optim.optimizer={optim.optimizer} use true "
           "(state parked on the CPU between updates) or false, or set optim.optimizer=adamw")
    _check(optim.optimizer != "adamw_bf16_sr" or fsdp.param_dtype == "bfloat16", f"{section}.fsdp.param_dtype",
           fsdp.param_dtype, f"{section}.optim.optimizer=adamw_bf16_sr keeps bfloat16 master weights: set bfloat16")


# --------------------------------------------------------------------------------------------------- actor
@dataclass(frozen=True)
class MoEConfig:
    # Mixture-of-Experts models: the trainer's forwards route each token to the experts the rollout engine chose
    # (`routed_experts`, engine/moe_replay.py) instead of re-routing with the trainer's numerics
    routing_replay: bool = False
    # weight of the routers' load-balancing loss (Switch Transformer's, as HF computes it) in the actor's update
    # loss (engine/moe_aux.py); 0 = off
    aux_loss_coef: float = 0.0

    def __post_init__(self) -> None:
        _check(self.aux_loss_coef >= 0, "actor.moe.aux_loss_coef", self.aux_loss_coef,
               "must be >= 0 (0 = off; transformers' Qwen3-MoE and Mixtral config classes default router_aux_loss_coef to 0.001)")


@dataclass(frozen=True)
class ActorConfig:
    ppo_mini_batch_size: int  # PROMPTS per optimizer step, global
    ppo_micro_batch_size_per_gpu: int  # SAMPLES per forward/backward per GPU
    use_dynamic_bsz: bool  # micro-batches by token budget instead of a fixed sample count
    ppo_max_token_len_per_gpu: int  # TOKENS per micro-batch when use_dynamic_bsz
    log_prob_micro_batch_size_per_gpu: int  # SAMPLES per log-prob forward per GPU
    log_prob_max_token_len_per_gpu: int
    ppo_epochs: int
    shuffle: bool
    grad_clip: float
    policy_loss: str  # name in POLICY_LOSSES (vanilla | gspo | cispo | sapo | ...)
    clip_ratio: float
    clip_ratio_low: float | None  # null → clip_ratio
    clip_ratio_high: float | None  # null → clip_ratio (DAPO clip-higher: e.g. 0.28)
    clip_ratio_c: float  # dual-clip bound for negative advantages
    loss_agg_mode: str
    entropy_coeff: float
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    logprob_chunk_size: int  # tokens per chunk when computing log-probs / entropy (bounds the logits memory)
    optim: OptimConfig
    fsdp: FSDPConfig
    tau_pos: float = 1.0  # SAPO's gate temperature where the advantage is positive
    tau_neg: float = 1.05  # ... and where it is not (>= tau_pos)
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        _check(self.ppo_mini_batch_size >= 1, "actor.ppo_mini_batch_size", self.ppo_mini_batch_size, "must be >= 1")
        _check(self.ppo_micro_batch_size_per_gpu >= 1, "actor.ppo_micro_batch_size_per_gpu",
               self.ppo_micro_batch_size_per_gpu, "must be >= 1")
        _check(self.ppo_epochs >= 1, "actor.ppo_epochs", self.ppo_epochs, "must be >= 1")
        _one_of("actor.loss_agg_mode", self.loss_agg_mode,
                ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"))
        _check(self.grad_clip > 0, "actor.grad_clip", self.grad_clip, "must be > 0")
        _check(self.logprob_chunk_size >= 1, "actor.logprob_chunk_size", self.logprob_chunk_size, "must be >= 1")
        _check(self.tau_pos > 0, "actor.tau_pos", self.tau_pos, "must be > 0 (SAPO's paper: 1.0)")
        _check(self.tau_neg > 0, "actor.tau_neg", self.tau_neg, "must be > 0 (SAPO's paper: 1.05)")
        _check_optimizer_fits("actor", self.optim, self.fsdp)


# --------------------------------------------------------------------------------------------------- rollout
@dataclass(frozen=True)
class ValSamplingConfig:
    n: int
    do_sample: bool  # false = greedy
    temperature: float
    top_k: int
    top_p: float


@dataclass(frozen=True)
class MultiTurnConfig:
    """Agentic rollouts (`rollout/multi_turn.py`, `agentic/`): turns of generation with tool calls in between."""

    enable: bool  # false = one response per prompt (the single-turn engine)
    format: str  # tool-call format (agentic/formats.TOOL_FORMATS): hermes | hermes_plain
    tools: list[str]  # built-in tools offered (calculator, python)
    tool_config_path: str | None  # YAML of user tools: tools: [{class_name, config, tool_schema}]
    max_assistant_turns: int  # the trajectory ends after this many model turns
    max_tool_response_length: int  # tokens of one tool's response text (longer ones are cut)
    tool_timeout_s: float  # per turn's calls (they run concurrently); a late call answers an error
    tool_workers: int  # threads running tool calls (and interaction steps)
    interaction_config_path: str | None  # YAML: interaction: [{name, class_name, config}] (simulated user / game)
    max_user_turns: int  # interaction messages appended per trajectory (the first one, from reset, not counted)
    offer_tools_in_prompt: bool  # tool schemas go to apply_chat_template(tools=...) when the template reads them

    def __post_init__(self) -> None:
        _check(self.max_assistant_turns >= 1, "rollout.multi_turn.max_assistant_turns", self.max_assistant_turns,
               "must be >= 1")
        _check(self.max_tool_response_length >= 1, "rollout.multi_turn.max_tool_response_length",
               self.max_tool_response_length, "must be >= 1 (tokens)")
        _check(self.tool_timeout_s > 0, "rollout.multi_turn.tool_timeout_s", self.tool_timeout_s, "must be > 0")
        _check(self.tool_workers >= 1, "rollout.multi_turn.tool_workers", self.tool_workers, "must be >= 1")
        _check(self.max_user_turns >= 0, "rollout.multi_turn.max_user_turns", self.max_user_turns,
               "must be >= 0 (0 = the interaction only scores the first turn)")


@dataclass(frozen=True)
class AgentConfig:
    """Bring your own agent (`agentic/agents.py`): the engine behind an OpenAI-compatible endpoint, one agent task
    per sample x rollout.n talking to it; trajectories are the tokens the endpoint sampled."""

    mode: str  # builtin (the engine drives generation) | server (an agent drives it through the endpoint)
    path: str | None  # .py file (or dotted module) defining the agent
    name: str  # its `async def run(client, sample)` function or Agent class
    max_concurrency: int  # agent tasks in flight at once
    timeout_s: float  # per agent task; a late one ends its trajectory (agent/timeouts)
    workers: int  # processes running the agent tasks; 1 = the engine's, 0 = auto (one per 4 CPU cores, <= 8)
    host: str  # the endpoint's address (this host only by default)
    port: int  # 0 = any free port
    check_every: int  # decode steps between the server's looks for finished and arriving requests; 0 = the engine's
    switch_interval_ms: float | None  # the interpreter's thread switch interval while serving; None = Python's
    overlap: bool  # the serving loop's host work runs while the next decode chunk is on the device

    def __post_init__(self) -> None:
        _one_of("rollout.agent.mode", self.mode, ("builtin", "server"))
        _check(self.check_every >= 0, "rollout.agent.check_every", self.check_every,
               "must be >= 0 (0 = the engine's own: 8 decode steps on a GPU)")
        _check(self.switch_interval_ms is None or 0 < self.switch_interval_ms <= 100, "rollout.agent.switch_interval_ms",
               self.switch_interval_ms, "must be in (0, 100] milliseconds, or null to keep Python's (5 ms)")
        _check(self.mode == "builtin" or bool(self.path), "rollout.agent.path", self.path,
               "rollout.agent.mode=server needs the agent: a .py file or module defining rollout.agent.name")
        _check(self.max_concurrency >= 1, "rollout.agent.max_concurrency", self.max_concurrency, "must be >= 1")
        _check(self.timeout_s > 0, "rollout.agent.timeout_s", self.timeout_s, "must be > 0 (seconds)")
        _check(self.workers >= 0, "rollout.agent.workers", self.workers,
               "must be >= 0 (0 = one process per 4 CPU cores, 1 = the agents run in the engine's process)")
        _check(0 <= self.port < 65536, "rollout.agent.port", self.port, "must be in [0, 65535] (0 = any free port)")


@dataclass(frozen=True)
class RolloutConfig:
    name: str  # hybrid = our engine on the actor's weights; hf = transformers.generate (reference / fallback)
    n: int  # responses per prompt
    temperature: float
    top_k: int  # -1 = off
    top_p: float
    do_sample: bool
    ignore_eos: bool  # keep generating to max length (benchmarks)
    stop_token_ids: list[int]
    gpu_memory_utilization: float  # fraction of free device memory the KV cache may take
    max_num_seqs: int  # sequences decoded together
    max_num_batched_tokens: int  # prefill token budget per scheduler step
    kv_cache_tokens: int | None  # explicit KV budget in tokens (overrides gpu_memory_utilization; used on CPU)
    enforce_eager: bool  # no CUDA graphs
    free_cache_engine: bool  # release the KV cache when switching back to training
    tensor_model_parallel_size: int  # ranks of one generation group (tensor parallelism); 1 = off
    quantization: str  # none | fp8: decoder projections in float8 e4m3 at each switch (rollout/fp8.py)
    seed: int
    val_kwargs: ValSamplingConfig
    multi_turn: MultiTurnConfig
    agent: AgentConfig

    def __post_init__(self) -> None:
        _check(self.n >= 1, "rollout.n", self.n, "must be >= 1 (responses per prompt)")
        _check(self.temperature > 0, "rollout.temperature", self.temperature,
               "must be > 0; for greedy decoding set rollout.do_sample=false")
        _check(0.0 < self.top_p <= 1.0, "rollout.top_p", self.top_p, "must be in (0, 1]")
        _check(0.0 < self.gpu_memory_utilization < 1.0, "rollout.gpu_memory_utilization",
               self.gpu_memory_utilization, "must be in (0, 1)")
        _one_of("rollout.name", self.name, ("hybrid", "hf"))
        _check(self.tensor_model_parallel_size >= 1, "rollout.tensor_model_parallel_size",
               self.tensor_model_parallel_size, "must be >= 1 (1 = no tensor parallelism)")
        _one_of("rollout.quantization", self.quantization, ("none", "fp8"))
        if self.quantization == "fp8":
            _check(self.name == "hybrid", "rollout.name", self.name,
                   "rollout.quantization=fp8 needs our engine (rollout.name=hybrid); or set rollout.quantization=none")
            _check(self.tensor_model_parallel_size == 1, "rollout.tensor_model_parallel_size",
                   self.tensor_model_parallel_size, "rollout.quantization=fp8 runs one rank per model: set it to 1, "
                   "or set rollout.quantization=none")
        _check(not (self.multi_turn.enable and self.name == "hf"), "rollout.multi_turn.enable", True,
               "needs our engine (rollout.name=hybrid): the hf fallback generates one turn")
        _check(not (self.agent.mode == "server" and self.multi_turn.enable), "rollout.agent.mode", "server",
               "replaces rollout.multi_turn (the agent runs the tools); set rollout.multi_turn.enable=false")


@dataclass(frozen=True)
class ActorRolloutConfig:
    backend: str  # only `hybrid` for now: one worker trains and generates on the same GPUs and weights
    # both engines run the batch-invariant ops (engine/invariant.py): the rollout's log-probs equal the trainer's
    # bit for bit, and in sync mode the old_log_prob recompute is skipped (needs packed forwards, one rollout rank)
    exact_logprobs: bool = False

    def __post_init__(self) -> None:
        _check(self.backend == "hybrid", "actor_rollout.backend", self.backend,
               "only 'hybrid' is supported (actor and rollout share one worker and one copy of the weights)")


# --------------------------------------------------------------------------------------------------- ref
@dataclass(frozen=True)
class EMAConfig:
    enable: bool
    decay: float
    update_every: int  # steps between EMA updates of the reference policy

    def __post_init__(self) -> None:
        _check(0.0 < self.decay < 1.0, "ref.ema.decay", self.decay, "must be in (0, 1)")
        _check(self.update_every >= 1, "ref.ema.update_every", self.update_every, "must be >= 1")


@dataclass(frozen=True)
class RefConfig:
    log_prob_micro_batch_size_per_gpu: int
    fsdp: FSDPConfig
    ema: EMAConfig


@dataclass(frozen=True)
class TeacherConfig:
    """On-policy distillation (`algorithm.adv_estimator=distill`): a frozen teacher scores the student's samples."""

    model_path: str | None  # HF dir of the teacher (same tokenizer as the student, any size); null = `preset`
    preset: str | None  # random-init preset when no model_path (benchmarks); null with no model_path = no teacher
    task_reward_weight: float  # advantage = (teacher - student log-prob) + weight x the GRPO advantage of the reward
    log_prob_micro_batch_size_per_gpu: int
    fsdp: FSDPConfig

    def __post_init__(self) -> None:
        _check(math.isfinite(self.task_reward_weight) and self.task_reward_weight >= 0, "teacher.task_reward_weight",
               self.task_reward_weight, "must be a finite number >= 0 (0 = distillation only, e.g. 0.5 to mix in "
               "the task reward)")
        _check(self.log_prob_micro_batch_size_per_gpu >= 1, "teacher.log_prob_micro_batch_size_per_gpu",
               self.log_prob_micro_batch_size_per_gpu, "must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.model_path is not None or self.preset is not None


# --------------------------------------------------------------------------------------------------- critic
@dataclass(frozen=True)
class CriticConfig:
    enable: bool | None  # null = on when the advantage estimator needs values (gae)
    model_path: str | None  # null = initialise the backbone from the actor's model
    ppo_mini_batch_size: int  # PROMPTS per optimizer step, global
    ppo_micro_batch_size_per_gpu: int
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: int
    ppo_epochs: int
    shuffle: bool
    grad_clip: float
    cliprange_value: float
    loss_agg_mode: str
    warmup_steps: int  # steps that train only the critic before the actor starts updating
    optim: OptimConfig
    fsdp: FSDPConfig

    def __post_init__(self) -> None:
        _check(self.ppo_mini_batch_size >= 1, "critic.ppo_mini_batch_size", self.ppo_mini_batch_size, "must be >= 1")
        _check(self.ppo_epochs >= 1, "critic.ppo_epochs", self.ppo_epochs, "must be >= 1")
        _check_optimizer_fits("critic", self.optim, self.fsdp)


# --------------------------------------------------------------------------------------------------- reward
@dataclass(frozen=True)
class RewardSourceConfig:
    name: str  # a REWARD_FUNCTIONS name, `rule` (function chosen by data_source), `custom`, or `model`
    weight: float


@dataclass(frozen=True)
class CustomRewardConfig:
    """One function from a user's file. `reward.custom` is one of these (the `custom` source is that function) or
    a list of them (the `custom` source is their mix: each is a source of its own named after its function, with
    the `custom` source's weight times its `weight`, as `hybridflow.train(reward_fns=[...])` does)."""

    path: str | None  # python file defining the function
    name: str = "compute_score"  # verl signature compute_score(data_source, solution_str, ground_truth, extra_info)
    weight: float = 1.0  # in a list: this function's share of the custom source

    def __post_init__(self) -> None:
        _check(math.isfinite(self.weight), "reward.custom.weight", self.weight, "must be a finite number, e.g. 1.0")


@dataclass(frozen=True)
class RewardModelConfig:
    enable: bool
    path: str | None
    micro_batch_size_per_gpu: int
    fsdp: FSDPConfig
    score_norm: str | None = None  # null | running: whiten RM scores by the running mean/std of training batches
    score_clip: float | None = None  # clip the (normalised) RM score to [-score_clip, score_clip]; null = no clip

    def __post_init__(self) -> None:
        if self.score_norm is not None:
            _one_of("reward.reward_model.score_norm", self.score_norm, ("running",))
        if self.score_clip is not None:
            _check(self.score_clip > 0, "reward.reward_model.score_clip", self.score_clip,
                   "must be > 0 (scores are clipped to ±score_clip) or null (no clip)")


@dataclass(frozen=True)
class JudgeConfig:
    """LLM-as-judge (`reward.sources` entry `judge`): a frozen causal LM reads `template` filled with the prompt, the
    response and the ground truth, and its generated verdict is parsed into the score (rewards/judge.py)."""

    path: str | None  # HF directory of the judge model (with its tokenizer; may differ from the policy's)
    template: str  # {prompt}, {response} and {ground_truth} are replaced by the row's text
    verdict_regex: str  # the first match's one group, read as a number, is the score
    verdict_fn: str | None  # "file.py:function": function(text) -> float | None (None = unparsed); replaces the regex
    temperature: float  # 0 = greedy
    max_new_tokens: int
    max_prompt_length: int  # judge tokens; a longer filled template is an error (fallback_score)
    batch_size: int  # judge prompts per generate call
    fallback_score: float  # score of an unparsed verdict or a failed row (counted: reward/judge_unparsed, _errors)

    def __post_init__(self) -> None:
        _check(self.temperature >= 0, "reward.judge.temperature", self.temperature, "must be >= 0 (0 = greedy)")
        for key in ("max_new_tokens", "max_prompt_length", "batch_size"):
            _check(getattr(self, key) >= 1, f"reward.judge.{key}", getattr(self, key), "must be >= 1")
        _check("{response}" in self.template, "reward.judge.template", self.template,
               "must contain {response} (the judge has to read the answer it scores)")
        _check(math.isfinite(self.fallback_score), "reward.judge.fallback_score", self.fallback_score,
               "must be a finite number, e.g. 0.0")
        _check(self.verdict_fn is None or ".py:" in self.verdict_fn, "reward.judge.verdict_fn", self.verdict_fn,
               "must be 'file.py:function' (a function of the judge's text returning a float or None), or null")
        if self.verdict_fn is None:
            try:
                groups = re.compile(self.verdict_regex).groups
            except re.error as err:
                raise ValueError(f"reward.judge.verdict_regex={self.verdict_regex!r}: not a regex ({err})") from None
            _check(groups == 1, "reward.judge.verdict_regex", self.verdict_regex,
                   "must have exactly one group, the score, e.g. 'Score: *([0-9.]+)'")


@dataclass(frozen=True)
class LengthPenaltyConfig:
    enable: bool
    coef: float  # reward -= coef * response_length / max_response_length


@dataclass(frozen=True)
class OverlongBufferConfig:
    enable: bool  # DAPO soft overlong punishment
    len: int
    penalty_factor: float


@dataclass(frozen=True)
class SandboxConfig:
    """Caps for policy code run by code rewards (`sandbox/__init__.py`); a row's extra_info may only lower them."""

    allow_unisolated: bool  # run code rewards even where no sandbox works (rlimits only: unsafe; root → uid 65534)
    timeout_s: float  # wall clock per program run
    memory_mb: int  # RLIMIT_AS
    max_output_mb: int  # stdout/stderr kept, and the largest file the program may write (RLIMIT_FSIZE)
    disk_mb: int  # size of the private writable tmpfs
    max_processes: int  # RLIMIT_NPROC (fork bombs)

    def __post_init__(self) -> None:
        for key in ("timeout_s", "memory_mb", "max_output_mb", "disk_mb", "max_processes"):
            _check(getattr(self, key) > 0, f"reward.sandbox.{key}", getattr(self, key), "must be > 0")
        _check(self.memory_mb >= 64, "reward.sandbox.memory_mb", self.memory_mb,
               "must be >= 64 (a Python interpreter needs ~30 MB of address space to start)")


@dataclass(frozen=True)
class RewardConfig:
    sources: list[RewardSourceConfig] | None  # null = custom when reward.custom names a function, else rule
    custom: CustomRewardConfig | list[CustomRewardConfig]  # one function, or several mixed by their weights
    reward_model: RewardModelConfig
    judge: JudgeConfig
    sandbox: SandboxConfig
    num_workers: int  # processes scoring responses (0 = in the driver process)
    overlap: bool  # score while the log-prob / value stages run on the workers
    timeout_s: float  # per response
    error_score: float  # score for a response whose scorer raised, timed out or returned NaN or a non-number
    success_threshold: float  # correct = the scorer's `acc` when it returns one, else score >= this
    length_penalty: LengthPenaltyConfig
    overlong_buffer: OverlongBufferConfig

    def __post_init__(self) -> None:
        self._check_custom_list()
        if self.sources is None:  # a default, filled in (not derived): the resolved config shows the real list
            name = "custom" if self.custom_functions else "rule"
            object.__setattr__(self, "sources", [RewardSourceConfig(name=name, weight=1.0)])
        elif self.custom_functions and not any(s.name == "custom" for s in self.sources):
            logger.warning("reward.custom names %s but reward.sources=%s does not name 'custom', so it is not "
                           "used; add {name: custom, weight: 1.0} to reward.sources (or leave reward.sources unset "
                           "to score with it alone)", [f.path for f in self.custom_functions],
                           [s.name for s in self.sources])
        _check(len(self.sources) >= 1, "reward.sources", self.sources,
               "give at least one source, e.g. [{name: rule, weight: 1.0}]")
        _check(self.timeout_s > 0, "reward.timeout_s", self.timeout_s, "must be > 0 seconds")
        _check(self.num_workers >= 0, "reward.num_workers", self.num_workers, "must be >= 0")
        _check(self.judge.path is not None or all(s.name != "judge" for s in self.sources), "reward.judge.path",
               None, "reward.sources names 'judge': set it to the judge model's HF directory")
        _check(math.isfinite(self.success_threshold), "reward.success_threshold", self.success_threshold,
               "must be a finite number (a response counts as correct when its score >= it), e.g. 1.0")

    @property
    def custom_functions(self) -> list[CustomRewardConfig]:
        """The functions `reward.custom` names: its list, or the single function when its path is set."""
        if isinstance(self.custom, list):
            return list(self.custom)
        return [self.custom] if self.custom.path else []

    def _check_custom_list(self) -> None:
        """A list's functions become sources named after them (their metrics `reward/<name>/mean`): each needs a
        path, and the names must be distinct and not another source's."""
        if not isinstance(self.custom, list):
            return
        _check(len(self.custom) >= 1, "reward.custom", self.custom,
               "give at least one {path, name, weight}, or null the path of the single form")
        taken = {"rule", "custom", "model", *(s.name for s in self.sources or [])}
        for i, fn in enumerate(self.custom):
            _check(bool(fn.path), f"reward.custom[{i}].path", fn.path, "must name the .py file defining the function")
            _check(fn.name not in taken, f"reward.custom[{i}].name", fn.name,
                   "must differ from the other functions' names and from rule, custom, model and reward.sources' "
                   "names (it names the source and its metrics, reward/<name>/mean); rename the function")
            taken.add(fn.name)


# --------------------------------------------------------------------------------------------------- algorithm
KL_CTRL_ALIASES = {"kl_controller": "adaptive"}


@dataclass(frozen=True)
class KLCtrlConfig:
    type: str  # fixed | adaptive (alias: kl_controller)
    kl_coef: float
    target_kl: float
    horizon: int

    def __post_init__(self) -> None:
        # An alias is canonicalised, not derived: the resolved config shows the real name.
        object.__setattr__(self, "type", KL_CTRL_ALIASES.get(self.type, self.type))
        _one_of("algorithm.kl_ctrl.type", self.type, ("fixed", "adaptive"))
        _check(self.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", self.kl_coef, "must be >= 0")
        _check(self.horizon >= 1, "algorithm.kl_ctrl.horizon", self.horizon, "must be >= 1")
        _check(self.target_kl > 0, "algorithm.kl_ctrl.target_kl", self.target_kl, "must be > 0")


@dataclass(frozen=True)
class FilterGroupsConfig:
    enable: bool  # DAPO dynamic sampling: drop groups whose rewards are all equal, sample more
    max_num_gen_batches: int  # bound on extra generation rounds per step


@dataclass(frozen=True)
class RolloutISConfig:
    """Off-policy correction between the rollout engine's log-probs and the trainer's (algorithms/rollout_is.py)."""

    mode: str | None  # null = off | tis (weight min(ratio, cap)) | mask (drop tokens with ratio outside [1/cap, cap])
    #                   | auto: tis with rollout.quantization=fp8, else off (decided by config/resolved.py:rollout_is)
    cap: float  # C: the TIS truncation, and the mask's band [1/C, C]

    def __post_init__(self) -> None:
        from hybridflow.algorithms.rollout_is import ROLLOUT_IS_MODES

        if self.mode is not None:
            _check(self.mode in (*ROLLOUT_IS_MODES, "auto"), "algorithm.rollout_is.mode", self.mode,
                   "must be tis, mask or null (off), or auto (tis with rollout.quantization=fp8); verl's "
                   "rollout_is_mode=truncate is tis")
        _check(self.cap > 1, "algorithm.rollout_is.cap", self.cap,
               "must be > 1 (TIS truncates the ratio at cap; mask keeps ratios in [1/cap, cap]); 2.0 is typical")


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str  # name in ADVANTAGE_ESTIMATORS
    gamma: float
    lam: float
    norm_adv_by_std: bool  # false = Dr.GRPO
    use_kl_in_reward: bool
    kl_penalty: str  # KL estimator used in the reward
    kl_ctrl: KLCtrlConfig
    filter_groups: FilterGroupsConfig
    rollout_is: RolloutISConfig
    preset: str | None = None  # a named overrides list (config/presets.py), e.g. robust; applied by the loader

    def __post_init__(self) -> None:
        if self.preset is not None:
            _one_of("algorithm.preset", self.preset, tuple(sorted(ALGORITHM_PRESETS)))


# --------------------------------------------------------------------------------------------------- trainer
@dataclass(frozen=True)
class CheckpointConfig:
    save_freq: int  # steps between saves; -1 = only at the end; 0 = never
    atomic_save: bool
    async_save: bool
    keep_last_n: int | None  # null = keep all

    def __post_init__(self) -> None:
        if self.keep_last_n is not None:
            _check(self.keep_last_n >= 1, "trainer.checkpoint.keep_last_n", self.keep_last_n, "must be >= 1 or null")


LOWER_IS_BETTER = ("loss", "nll", "error", "err", "perplexity", "ppl", "kl", "wer", "cer")  # rollback.mode=auto


@dataclass(frozen=True)
class RollbackConfig:
    enable: bool  # reload the best checkpoint on the health monitor's val_drop (trainer.health.val_drop_patience)
    metric: str
    lr_scale: float
    max_rollbacks: int
    mode: str = "auto"  # max | min | auto (min when a word of the metric's name is in LOWER_IS_BETTER, else max)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "max", "min"):
            raise ValueError(f"trainer.rollback.mode={self.mode!r}: must be max (higher is better), min or auto")

    def higher_is_better(self) -> bool:
        if self.mode != "auto":
            return self.mode == "max"
        words = re.split(r"[/_.\-]", self.metric.lower())  # whole words: val/nll, val/error_rate; not "applicability"
        return not any(w in LOWER_IS_BETTER for w in words)


@dataclass(frozen=True)
class HealthConfig:
    gen_time_warn_s: float
    update_jitter_warn_s: float
    jitter_window: int
    val_drop_patience: int
    memory_warn_frac: float


TRAINER_MODES = ("sync", "one_step_off", "async")
PARTIAL_ROLLOUT_MODES = ("abort", "continue")
WEIGHT_TRANSPORTS = ("auto", "collective", "call")


@dataclass(frozen=True)
class AsyncConfig:
    """`trainer.async` (the YAML key; `async` is a Python keyword, so the field is `async_`): the bounded-staleness
    mode (`trainer.mode=async`, hybridflow/trainer/async_driver.py)."""

    max_staleness: int  # policy versions a trained sample may lag the policy being trained (0 = on-policy)
    # abort: weights change only between requests; continue: in-flight sequences take new weights between decode
    # chunks (per-token versions). Either way a request whose oldest token is too stale when consumed is dropped
    # and its prompts resubmitted.
    partial_rollout: str
    chunk_prompts: int | None  # prompts per generation request (the streaming unit); null = train_batch_size / 4
    weight_check_steps: int | None  # continue: decode steps between weight checks; null = the engine's host-check
    #                                 interval (8 on GPU, 1 on CPU)

    def __post_init__(self) -> None:
        _check(self.max_staleness >= 0, "trainer.async.max_staleness", self.max_staleness,
               "must be >= 0 policy versions (0 = every sample from the policy being trained)")
        _one_of("trainer.async.partial_rollout", self.partial_rollout, PARTIAL_ROLLOUT_MODES)
        _check(self.chunk_prompts is None or self.chunk_prompts >= 1, "trainer.async.chunk_prompts",
               self.chunk_prompts, "must be >= 1 prompt, or null (train_batch_size / 4)")
        _check(self.weight_check_steps is None or self.weight_check_steps >= 1, "trainer.async.weight_check_steps",
               self.weight_check_steps, "must be >= 1 decode step, or null (the engine's host-check interval)")


@dataclass(frozen=True)
class WeightSyncConfig:
    """Trainer → rollout weight broadcast in the non-sync modes."""

    bucket_mb: float  # parameters are packed into flat buckets of at most this size (one tensor per bucket)
    # auto (collective on the Ray backend, call on the local one) | collective (a broadcast over a process group of
    # actor rank 0 + the rollout workers: NCCL on GPU, gloo on CPU) | call (the buckets as call arguments)
    transport: str
    timeout_s: float  # collective: a broadcast that has not finished this long after every member joined it fails

    def __post_init__(self) -> None:
        _check(self.bucket_mb > 0, "trainer.weight_sync.bucket_mb", self.bucket_mb, "must be > 0 MiB")
        _one_of("trainer.weight_sync.transport", self.transport, WEIGHT_TRANSPORTS)
        _check(self.timeout_s > 0, "trainer.weight_sync.timeout_s", self.timeout_s, "must be > 0 seconds")


@dataclass(frozen=True)
class TrainerConfig:
    project_name: str
    experiment_name: str
    total_epochs: int
    total_training_steps: int | None  # null = epochs × batches per epoch
    seed: int
    device: str  # auto | cpu | cuda
    cpu_threads: int  # intra-op threads, 0 = auto (hybridflow.utils.threads)
    backend: str  # auto | local | ray
    ray_address: str | None  # a running Ray cluster to join (`ray start --head` printed it; "auto": this machine's)
    nnodes: int
    n_gpus_per_node: int  # processes per node (GPUs, or CPU ranks when device=cpu)
    use_hybrid_engine: bool
    use_colocated_worker: bool
    logger: list[str]
    log_every: int
    test_freq: int  # steps between validations; -1 = only at the end
    val_before_train: bool
    log_val_generations: int
    run_dir: str  # metrics, events, config, report
    overwrite: bool  # a fresh run into a run_dir holding another run's metrics replaces them (else refused)
    default_local_dir: str
    default_hdfs_dir: str | None  # fsspec URL mirrored after each local save
    resume_mode: str  # auto | disable | path
    resume_path: str | None
    checkpoint: CheckpointConfig
    rollback: RollbackConfig
    max_consecutive_bad_steps: int
    hang_timeout_s: float | None  # a stage without progress this long stops the run with stacks dumped; 0/null = off
    health: HealthConfig
    mode: str  # sync | one_step_off | async (trainer/async_driver.py)
    async_: AsyncConfig  # YAML key `async`
    weight_sync: WeightSyncConfig

    def __post_init__(self) -> None:
        check_path_name("trainer.project_name", self.project_name)
        check_path_name("trainer.experiment_name", self.experiment_name)
        _one_of("trainer.mode", self.mode, TRAINER_MODES)
        _one_of("trainer.backend", self.backend, ("auto", "local", "ray"))
        _one_of("trainer.device", self.device, ("auto", "cpu", "cuda"))
        _check(self.cpu_threads >= 0, "trainer.cpu_threads", self.cpu_threads, "must be 0 (auto) or a thread count")
        _one_of("trainer.resume_mode", self.resume_mode, ("auto", "disable", "path"))
        _check(self.nnodes >= 1, "trainer.nnodes", self.nnodes, "must be >= 1")
        _check(self.n_gpus_per_node >= 1, "trainer.n_gpus_per_node", self.n_gpus_per_node, "must be >= 1")
        _check(self.total_epochs >= 1, "trainer.total_epochs", self.total_epochs, "must be >= 1")
        _check(self.hang_timeout_s is None or self.hang_timeout_s >= 0, "trainer.hang_timeout_s", self.hang_timeout_s,
               "must be seconds >= 0 (0 or null turns the hang watchdog off)")
        if self.resume_mode == "path":
            _check(bool(self.resume_path), "trainer.resume_path", self.resume_path,
                   "trainer.resume_mode=path needs trainer.resume_path=<checkpoint dir>")


@dataclass(frozen=True)
class ResourcePoolConfig:
    process_on_nodes: list[int] | None  # processes per node; null = [n_gpus_per_node] * nnodes
    max_colocate_count: int  # worker processes that may share one GPU
    rollout_process_on_nodes: list[int]  # non-sync modes: the rollout workers' own pool (processes per node)

    def __post_init__(self) -> None:
        _check(self.max_colocate_count >= 1, "resource_pool.max_colocate_count", self.max_colocate_count, "must be >= 1")
        _check(bool(self.rollout_process_on_nodes) and all(n >= 1 for n in self.rollout_process_on_nodes),
               "resource_pool.rollout_process_on_nodes", self.rollout_process_on_nodes,
               "must be a non-empty list of positive process counts, e.g. [1]")


# --------------------------------------------------------------------------------------------------- sft / rm
@dataclass(frozen=True)
class SFTConfig:
    """`hybridflow sft`: rows from data.task or data.train_files (`messages`, `prompt` + `response`, `prompt` +
    `completion` or `text`: data/layouts.py)."""

    epochs: int  # passes over the training rows (used when total_steps is null)
    total_steps: int | None  # optimizer steps; null = epochs × batches per epoch
    batch_size: int  # SEQUENCES per optimizer step, global
    micro_batch_size_per_gpu: int  # SEQUENCES per forward/backward per GPU
    grad_clip: float
    optim: OptimConfig
    export_dir: str | None  # HF model directory written at the end; null = <trainer.run_dir>/hf
    label_noise: float  # built-in tasks only: share of SFT answers replaced by a systematic near miss (answer + 1)
    target_val_loss: float | None = None  # the warm start's criterion: val/loss <= this (checked at each validation)
    stop_at_target: bool = True  # true: stop as soon as the target holds (total_steps caps); false: train the whole
    # schedule and check the target at the end; either way a missed target is a warning and an event
    extra_schedules: int = 0  # target missed at the end: up to this many more warm-up + cosine schedules
    extra_schedule_steps: int = 500  # steps of each extra schedule

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, "sft.epochs", self.epochs, "must be >= 1")
        _check(self.extra_schedules >= 0, "sft.extra_schedules", self.extra_schedules, "must be >= 0")
        _check(self.extra_schedule_steps >= 1, "sft.extra_schedule_steps", self.extra_schedule_steps, "must be >= 1")
        if self.target_val_loss is not None:
            _check(self.target_val_loss > 0, "sft.target_val_loss", self.target_val_loss,
                   "must be > 0 (a validation loss to stop at) or null (train total_steps)")
        _check(0.0 <= self.label_noise < 1.0, "sft.label_noise", self.label_noise, "must be in [0, 1)")
        _check(self.batch_size >= 1, "sft.batch_size", self.batch_size, "must be >= 1 (sequences per step)")
        _check(self.micro_batch_size_per_gpu >= 1, "sft.micro_batch_size_per_gpu", self.micro_batch_size_per_gpu,
               "must be >= 1")
        if self.total_steps is not None:
            _check(self.total_steps >= 1, "sft.total_steps", self.total_steps, "must be >= 1 or null")


@dataclass(frozen=True)
class RMConfig:
    """`hybridflow rm`: Bradley-Terry reward model from `prompt`/`chosen`/`rejected` rows (or a built-in task's
    synthetic pairs)."""

    epochs: int
    total_steps: int | None  # optimizer steps; null = epochs × batches per epoch
    batch_size: int  # PAIRS per optimizer step, global
    micro_batch_size_per_gpu: int  # PAIRS per forward/backward per GPU
    margin: float  # loss = -logsigmoid(r_chosen - r_rejected - margin)
    init_from: str | None  # HF dir (SFT export, causal LM or classifier); overrides model.path; null = model.path
    grad_clip: float
    optim: OptimConfig
    export_dir: str | None  # HF reward-model directory written at the end; null = <trainer.run_dir>/hf
    synthetic_mix: dict[str, float]  # built-in task pairs: weights of the rejected kinds; {} = the task's default

    def __post_init__(self) -> None:
        _check(self.epochs >= 1, "rm.epochs", self.epochs, "must be >= 1")
        _check(self.batch_size >= 1, "rm.batch_size", self.batch_size, "must be >= 1 (pairs per step)")
        _check(self.micro_batch_size_per_gpu >= 1, "rm.micro_batch_size_per_gpu", self.micro_batch_size_per_gpu,
               "must be >= 1")
        if self.total_steps is not None:
            _check(self.total_steps >= 1, "rm.total_steps", self.total_steps, "must be >= 1 or null")


@dataclass(frozen=True)
class DPOConfig:
    """`hybridflow dpo`: offline preference optimisation (DPO / IPO / SimPO) of a causal LM on `prompt`/`chosen`/
    `rejected` rows (or a built-in task's synthetic pairs); the reference is the starting model, frozen."""

    loss_type: str  # dpo (sigmoid; label_smoothing > 0 = cDPO) | ipo | simpo (reference-free, length-normalised)
    beta: float  # dpo/ipo: KL strength β (ipo: τ); simpo: reward scale β
    label_smoothing: float  # dpo/simpo: ε, the share of pairs assumed mislabelled (cDPO); ipo: must be 0
    gamma: float  # simpo only: target reward margin γ
    epochs: int
    total_steps: int | None  # optimizer steps; null = epochs × batches per epoch
    batch_size: int  # PAIRS per optimizer step, global
    micro_batch_size_per_gpu: int  # PAIRS per forward/backward per GPU (2 × rows: chosen and rejected together)
    init_from: str | None  # HF dir of the starting (and reference) model, e.g. an SFT export; null = model.path
    grad_clip: float
    optim: OptimConfig
    export_dir: str | None  # HF model directory written at the end; null = <trainer.run_dir>/hf
    synthetic_mix: dict[str, float]  # built-in task pairs: weights of the rejected kinds; {} = the task's default
    precompute_ref: bool = False  # reference log-probs of every pair in a first pass, then the reference is freed
    val_generate: bool = True  # validation also scores greedy answers to the val prompts when their data_source has
    # a scorer (val/accuracy, as `hybridflow train`); false = the pair metrics only
    online: bool = False  # online DPO: pairs sampled by the rollout engine (rollout.n per prompt), ranked by reward.*;
    # the run is then sized like `hybridflow train` (data.train_batch_size prompts, trainer.total_training_steps,
    # actor.optim); dpo.* gives the loss (loss_type, beta, label_smoothing, gamma) and init_from

    def __post_init__(self) -> None:
        from hybridflow.algorithms.preference import PREFERENCE_LOSSES

        _one_of("dpo.loss_type", self.loss_type, PREFERENCE_LOSSES)
        _check(self.beta > 0, "dpo.beta", self.beta, "must be > 0 (e.g. 0.1 for dpo/ipo, 2.0 for simpo)")
        _check(0.0 <= self.label_smoothing < 0.5, "dpo.label_smoothing", self.label_smoothing,
               "must be in [0, 0.5) (0 = plain DPO; cDPO uses e.g. 0.1)")
        _check(self.loss_type != "ipo" or self.label_smoothing == 0.0, "dpo.label_smoothing", self.label_smoothing,
               "is not defined for dpo.loss_type=ipo; set dpo.label_smoothing=0 or use loss_type=dpo (cDPO)")
        _check(self.gamma >= 0, "dpo.gamma", self.gamma, "must be >= 0 (SimPO's target reward margin)")
        _check(self.epochs >= 1, "dpo.epochs", self.epochs, "must be >= 1")
        _check(self.batch_size >= 1, "dpo.batch_size", self.batch_size, "must be >= 1 (pairs per step)")
        _check(self.micro_batch_size_per_gpu >= 1, "dpo.micro_batch_size_per_gpu", self.micro_batch_size_per_gpu,
               "must be >= 1")
        if self.total_steps is not None:
            _check(self.total_steps >= 1, "dpo.total_steps", self.total_steps, "must be >= 1 or null")


# --------------------------------------------------------------------------------------------------- root
@dataclass(frozen=True)
class Config:
    model: ModelConfig
    data: DataConfig
    actor: ActorConfig
    rollout: RolloutConfig
    actor_rollout: ActorRolloutConfig
    ref: RefConfig
    teacher: TeacherConfig
    critic: CriticConfig
    reward: RewardConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    resource_pool: ResourcePoolConfig
    sft: SFTConfig
    rm: RMConfig
    dpo: DPOConfig
    extra: dict[str, Any] = field(default_factory=dict)  # free-form, for user scripts
