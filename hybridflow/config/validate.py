"""Checks that span several sections: resource shapes and batch-size arithmetic, with the arithmetic shown."""

from __future__ import annotations

from hybridflow.config.dotted import ConfigError
from hybridflow.config.resolved import process_on_nodes, resolve
from hybridflow.config.schema import Config


def validate_config(cfg: Config, command: str = "train") -> None:
    """Raise `ConfigError` listing every problem found (not just the first). `command`: train checks everything;
    sft, rm and offline dpo skip what only RL reads (rollout/actor batch arithmetic, estimators, trainer modes)."""
    rl = command == "train" or (command == "dpo" and cfg.dpo.online)
    errors = _resource_errors(cfg)
    if rl and not errors:
        errors += _batch_errors(cfg)
    if rl:
        errors += _name_errors(cfg) + _online_dpo_errors(cfg) + _mode_errors(cfg) + _teacher_errors(cfg)
    if rl or command == "dpo":
        errors += _tp_errors(cfg, command)
    errors += _lora_errors(cfg) + _exact_errors(cfg)
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


def _resource_errors(cfg: Config) -> list[str]:
    t, rp = cfg.trainer, cfg.resource_pool
    errs = []
    if rp.process_on_nodes is not None:
        nodes = list(rp.process_on_nodes)
        if len(nodes) != t.nnodes:
            errs.append(
                f"resource_pool.process_on_nodes={nodes} lists {len(nodes)} node(s) but trainer.nnodes={t.nnodes}: "
                f"give one entry per node (e.g. resource_pool.process_on_nodes={[t.n_gpus_per_node] * t.nnodes}) "
                f"or set trainer.nnodes={len(nodes)}"
            )
        for i, count in enumerate(nodes):
            if not 1 <= count <= t.n_gpus_per_node:
                errs.append(
                    f"resource_pool.process_on_nodes[{i}]={count} must be between 1 and "
                    f"trainer.n_gpus_per_node={t.n_gpus_per_node} (processes cannot exceed GPUs on a node)"
                )
    if not t.use_colocated_worker and not errs:
        roles = resolve(cfg).num_roles
        if roles > 1 and rp.max_colocate_count < roles:
            errs.append(
                f"trainer.use_colocated_worker=false runs {roles} role processes per GPU but "
                f"resource_pool.max_colocate_count={rp.max_colocate_count}: set resource_pool.max_colocate_count={roles} "
                f"or trainer.use_colocated_worker=true"
            )
    return errs


def _batch_errors(cfg: Config) -> list[str]:
    errs = []
    world = sum(process_on_nodes(cfg))
    prompts, n = cfg.data.train_batch_size, cfg.rollout.n
    roles = [("actor", cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu, cfg.actor.use_dynamic_bsz)]
    if resolve(cfg).use_critic:
        c = cfg.critic
        roles.append(("critic", c.ppo_mini_batch_size, c.ppo_micro_batch_size_per_gpu, c.use_dynamic_bsz))
    for role, mini, micro, dynamic in roles:
        if mini > prompts or prompts % mini:
            errs.append(
                f"data.train_batch_size={prompts} prompts must be a multiple of {role}.ppo_mini_batch_size={mini} "
                f"prompts ({prompts} / {mini} = {prompts / mini:.2f} mini-batches per step); "
                f"e.g. {role}.ppo_mini_batch_size={_largest_divisor_at_most(prompts, mini)}"
            )
            continue
        samples = mini * n
        if samples % world:
            errs.append(
                f"{role}.ppo_mini_batch_size={mini} prompts x rollout.n={n} = {samples} samples per mini-batch "
                f"must split evenly over {world} processes (trainer.nnodes x n_gpus_per_node): "
                f"{samples} / {world} = {samples / world:.2f}"
            )
            continue
        per_gpu = samples // world
        if not dynamic and micro < per_gpu and per_gpu % micro:
            errs.append(
                f"{samples} samples per mini-batch / {world} processes = {per_gpu} samples per process, not a "
                f"multiple of {role}.ppo_micro_batch_size_per_gpu={micro}; "
                f"e.g. {role}.ppo_micro_batch_size_per_gpu={_largest_divisor_at_most(per_gpu, micro)}"
            )
    total = prompts * n
    if total % world:
        errs.append(
            f"data.train_batch_size={prompts} x rollout.n={n} = {total} samples per step must split evenly over "
            f"{world} processes: {total} / {world} = {total / world:.2f}"
        )
    return errs


def _name_errors(cfg: Config) -> list[str]:
    errs = []
    try:
        from hybridflow.algorithms import ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, POLICY_LOSSES
    except ImportError:  # algorithms not installed in a stripped build: checked again when the trainer starts
        return errs
    for key, name, reg in (
        ("algorithm.adv_estimator", cfg.algorithm.adv_estimator, ADVANTAGE_ESTIMATORS),
        ("actor.policy_loss", cfg.actor.policy_loss, POLICY_LOSSES),
        ("actor.kl_loss_type", cfg.actor.kl_loss_type, KL_ESTIMATORS),
        ("algorithm.kl_penalty", cfg.algorithm.kl_penalty, KL_ESTIMATORS),
    ):
        if name not in reg:
            errs.append(f"{key}={name!r} is not registered; choose one of {', '.join(reg.names())}")
    return errs


def _largest_divisor_at_most(total: int, bound: int) -> int:
    for d in range(min(bound, total), 0, -1):
        if total % d == 0:
            return d
    return 1


def _lora_errors(cfg: Config) -> list[str]:
    lora = cfg.model.lora
    if lora.enabled and cfg.ref.ema.enable:
        return [f"model.lora.rank={lora.rank} with ref.ema.enable=true: with LoRA the reference is the actor with "
                "its adapters disabled (no second model), which cannot be an EMA; set ref.ema.enable=false or "
                "model.lora.rank=0"]
    return []


def _mode_errors(cfg: Config) -> list[str]:
    """trainer.mode=one_step_off|async: what the separate rollout workers do not support yet."""
    mode = cfg.trainer.mode
    if mode == "sync":
        return []
    errs = []
    if cfg.trainer.weight_sync.transport == "collective" and cfg.trainer.backend == "local":
        errs.append("trainer.weight_sync.transport=collective with trainer.backend=local: the local backend runs the "
                    "rollout worker in the trainer's own process, which has nobody to broadcast to; use "
                    "trainer.backend=ray or trainer.weight_sync.transport=call (or auto)")
    if mode == "one_step_off" and cfg.trainer.async_.partial_rollout == "continue":
        errs.append("trainer.async.partial_rollout=continue applies to trainer.mode=async (one_step_off sends new "
                    "weights between batches only); use trainer.mode=async or trainer.async.partial_rollout=abort")
    if mode == "async" and cfg.trainer.async_.partial_rollout == "continue" and cfg.rollout.agent.mode == "server":
        errs.append("trainer.async.partial_rollout=continue with rollout.agent.mode=server: the agent endpoint does not "
                    "take new weights while agents are in flight (no per-token policy versions for their sessions); "
                    "set trainer.async.partial_rollout=abort (new weights wait for the request in flight) or "
                    "rollout.agent.mode=builtin")
    if mode == "async":
        b, chunk = cfg.data.train_batch_size, cfg.trainer.async_.chunk_prompts
        chunk = chunk if chunk is not None else max(1, b // 4)
        if b % chunk:
            errs.append(f"trainer.async.chunk_prompts={chunk} must divide data.train_batch_size={b} (a training "
                        f"batch is whole generation requests); e.g. trainer.async.chunk_prompts={_divisor(b)}")
    return errs


def _tp_errors(cfg: Config, command: str) -> list[str]:
    """rollout.tensor_model_parallel_size > 1: generation groups of consecutive actor ranks (rollout/reshard.py)."""
    tp, t = cfg.rollout.tensor_model_parallel_size, cfg.trainer
    if tp == 1:
        return []
    key = f"rollout.tensor_model_parallel_size={tp}"
    world = sum(process_on_nodes(cfg))
    errs = []
    if world % tp:
        errs.append(f"{key} must divide the actor's {world} processes (trainer.nnodes={t.nnodes} x "
                    f"trainer.n_gpus_per_node={t.n_gpus_per_node}, or resource_pool.process_on_nodes): set it to a "
                    f"divisor of {world}, e.g. {_largest_divisor_at_most(world, tp)}")
    if t.mode != "sync":
        errs.append(f"{key} with trainer.mode={t.mode}: the separate rollout workers receive whole weights, not "
                    "per-rank tensor-parallel slices; use trainer.mode=sync or rollout.tensor_model_parallel_size=1")
    if command == "dpo":
        errs.append(f"{key} with hybridflow dpo: the DPO policy worker generates on one rank; set "
                    "rollout.tensor_model_parallel_size=1")
    if cfg.rollout.multi_turn.enable:
        errs.append(f"{key} with rollout.multi_turn.enable=true: every rank of a group would run the tools itself "
                    "and must get the same answers; set rollout.tensor_model_parallel_size=1 for multi-turn rollouts")
    if cfg.rollout.name == "hf" or cfg.rollout.agent.mode == "server":
        errs.append(f"{key} with rollout.name={cfg.rollout.name}, rollout.agent.mode={cfg.rollout.agent.mode}: HF "
                    "generate and the agent endpoint run one whole model per rank; use rollout.name=hybrid with "
                    "rollout.agent.mode=builtin, or rollout.tensor_model_parallel_size=1")
    return errs


def _exact_errors(cfg: Config) -> list[str]:
    """actor_rollout.exact_logprobs: the cases whose forwards have no batch-invariant form (engine/invariant.py)."""
    if not cfg.actor_rollout.exact_logprobs:
        return []
    key, fix = "actor_rollout.exact_logprobs=true", "or set actor_rollout.exact_logprobs=false"
    why = {"data.use_packed_dataset=false": not cfg.data.use_packed_dataset,
           f"rollout.tensor_model_parallel_size={cfg.rollout.tensor_model_parallel_size}":
               cfg.rollout.tensor_model_parallel_size > 1,
           "rollout.name=hf": cfg.rollout.name == "hf",
           "rollout.quantization=fp8": cfg.rollout.quantization == "fp8",
           f"model.lora.rank={cfg.model.lora.rank}": cfg.model.lora.enabled}
    return [f"{key} with {k}: the trainer's packed forward (with merged weights) on one rollout rank is what exact "
            f"mode makes the engine reproduce; change {k.split('=')[0]} {fix}" for k, bad in why.items() if bad]


def _divisor(n: int) -> int:
    return next(d for d in range(max(1, n // 4), 0, -1) if n % d == 0)


def _online_dpo_errors(cfg: Config) -> list[str]:
    """Online DPO pairs each prompt's best and worst response and trains them side by side in the actor's
    micro-batches, which must hold whole pairs."""
    if not cfg.dpo.online:
        return []
    errs, a = [], cfg.actor
    if cfg.rollout.n < 2:
        errs.append(f"dpo.online=true ranks several responses per prompt but rollout.n={cfg.rollout.n}: set "
                    "rollout.n >= 2 (e.g. 4; more responses make a tie of all rewards rarer)")
    if a.use_dynamic_bsz:
        errs.append("dpo.online=true trains (chosen, rejected) pairs in fixed micro-batches but actor.use_dynamic_bsz="
                    "true splits by tokens; set actor.use_dynamic_bsz=false")
    if a.ppo_micro_batch_size_per_gpu % 2:
        errs.append(f"dpo.online=true: actor.ppo_micro_batch_size_per_gpu={a.ppo_micro_batch_size_per_gpu} rows "
                    "would split a (chosen, rejected) pair; use an even number, e.g. "
                    f"actor.ppo_micro_batch_size_per_gpu={a.ppo_micro_batch_size_per_gpu + 1}")
    if cfg.ref.ema.enable:
        errs.append("dpo.online=true uses the starting policy as its frozen reference; set ref.ema.enable=false")
    return errs


def _teacher_errors(cfg: Config) -> list[str]:
    """On-policy distillation needs a teacher, and a teacher is only loaded for it."""
    t, estimator = cfg.teacher, cfg.algorithm.adv_estimator
    if estimator == "distill" and not t.enabled:
        return ["algorithm.adv_estimator=distill needs a teacher: set teacher.model_path=<HF dir with the student's "
                "tokenizer> (or teacher.preset for a random-init shape)"]
    if estimator != "distill" and t.enabled:
        return [f"teacher.model_path={t.model_path!r} / teacher.preset={t.preset!r} with algorithm.adv_estimator="
                f"{estimator}: the teacher is only used by on-policy distillation; set algorithm.adv_estimator="
                "distill, or teacher.model_path=null and teacher.preset=null"]
    if t.model_path is not None and t.preset is not None:
        return [f"teacher.model_path={t.model_path!r} and teacher.preset={t.preset!r}: give one (the preset is for "
                "random-init benchmarks); set teacher.preset=null"]
    return []
