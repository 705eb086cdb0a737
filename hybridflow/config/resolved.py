"""Numbers derived from the config (world size, samples per step, per-GPU mini/micro batches, which roles run).

Computed once from a validated `Config`; the config itself is never changed. Every count says its unit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hybridflow.config.schema import Config, RolloutISConfig

# Estimators that need a critic's values.
VALUE_ESTIMATORS = ("gae",)


@dataclass(frozen=True)
class RoleBatch:
    """Batch arithmetic for one trained role (actor or critic)."""

    mini_batch_prompts: int  # global
    mini_batch_samples: int  # global = prompts × rollout.n
    mini_batch_samples_per_gpu: int
    micro_batch_samples_per_gpu: int  # clamped to the per-GPU mini-batch
    num_mini_batches: int  # optimizer steps per epoch per training step
    grad_accum_steps: int  # micro-batches per mini-batch per GPU (fixed-size micro-batching)


@dataclass(frozen=True)
class Resolved:
    world_size: int
    process_on_nodes: tuple[int, ...]
    samples_per_step: int
    actor: RoleBatch
    critic: RoleBatch | None
    use_critic: bool
    use_reference: bool  # KL in reward or as a loss, or online DPO, needs reference log-probs
    use_reward_model: bool
    use_teacher: bool  # on-policy distillation: the teacher's log-probs of the sampled tokens
    # False when strictly on-policy (one epoch, one mini-batch): the loss's ratio is then 1 and its old log-probs
    # are the update's own, detached. True with the KL in the reward (the driver's KL(actor‖ref) then reads the
    # actor's log-probs from the same engine path as the reference's, so it is exactly 0 at step 1; the KL loss
    # needs no old log-probs: it compares the update's own log-probs with the reference's), with online DPO, and
    # with algorithm.rollout_is (its ratio is old_log_probs / rollout_log_probs).
    recompute_old_log_prob: bool
    # Where old log-probs are needed but `actor_rollout.exact_logprobs` makes the rollout's the trainer's, bit for bit
    # (sync mode: the sampling policy is the one before the update): copied, no forward pass.
    old_log_prob_from_rollout: bool = False
    rollout_is: RolloutISConfig | None = None  # `algorithm.rollout_is` as applied (auto decided); None = off

    @property
    def num_roles(self) -> int:
        return 1 + int(self.use_critic) + int(self.use_reward_model)


def process_on_nodes(cfg: Config) -> tuple[int, ...]:
    t = cfg.trainer
    given = cfg.resource_pool.process_on_nodes
    return tuple(given) if given is not None else (t.n_gpus_per_node,) * t.nnodes


def role_batch(mini_prompts: int, micro_per_gpu: int, train_prompts: int, n: int, world: int) -> RoleBatch:
    mini_samples = mini_prompts * n
    per_gpu = mini_samples // world
    micro = min(micro_per_gpu, per_gpu)
    return RoleBatch(
        mini_batch_prompts=mini_prompts,
        mini_batch_samples=mini_samples,
        mini_batch_samples_per_gpu=per_gpu,
        micro_batch_samples_per_gpu=micro,
        num_mini_batches=train_prompts // mini_prompts,
        grad_accum_steps=max(1, per_gpu // micro),
    )


def online_dpo_reference(cfg: Config) -> bool:
    """Online DPO (`dpo.online`) needs the reference policy's log-probs, except for the reference-free SimPO."""
    from hybridflow.algorithms.preference import REFERENCE_FREE

    return cfg.dpo.online and cfg.dpo.loss_type not in REFERENCE_FREE


def rollout_is(cfg: Config) -> RolloutISConfig | None:
    """`algorithm.rollout_is` with its mode as the run applies it, None when off. `auto` (the default) is tis with
    `rollout.quantization=fp8` (an fp8 rollout samples from a visibly different policy than the trainer scores:
    corrected unless told not to), else off. Decided here, from the config the run has, not when it is loaded: a
    config saved with `auto` and run again with another quantization, or one changed after loading, gets the default
    of its own quantization; a mode the user set (tis, mask, null) is never changed."""
    section = cfg.algorithm.rollout_is
    mode = section.mode
    if mode == "auto":
        mode = "tis" if cfg.rollout.quantization == "fp8" else None
    return None if mode is None else dataclasses.replace(section, mode=mode)


def resolve(cfg: Config) -> Resolved:
    nodes = process_on_nodes(cfg)
    world = sum(nodes)
    n = cfg.rollout.n
    prompts = cfg.data.train_batch_size
    use_critic = cfg.critic.enable if cfg.critic.enable is not None else cfg.algorithm.adv_estimator in VALUE_ESTIMATORS
    actor = role_batch(cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu, prompts, n, world)
    critic = (
        role_batch(cfg.critic.ppo_mini_batch_size, cfg.critic.ppo_micro_batch_size_per_gpu, prompts, n, world)
        if use_critic
        else None
    )
    use_reference = cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward or online_dpo_reference(cfg)
    is_cfg = rollout_is(cfg)
    needs_old = (cfg.algorithm.use_kl_in_reward or online_dpo_reference(cfg) or is_cfg is not None
                 or not (cfg.actor.ppo_epochs == 1 and actor.num_mini_batches == 1))
    from_rollout = needs_old and cfg.actor_rollout.exact_logprobs and cfg.trainer.mode == "sync" and not cfg.dpo.online
    return Resolved(
        world_size=world,
        process_on_nodes=nodes,
        samples_per_step=prompts * n,
        actor=actor,
        critic=critic,
        use_critic=use_critic,
        use_reference=use_reference,
        use_reward_model=cfg.reward.reward_model.enable or any(s.name == "model" for s in cfg.reward.sources),
        use_teacher=cfg.algorithm.adv_estimator == "distill",
        recompute_old_log_prob=needs_old and not from_rollout,
        old_log_prob_from_rollout=from_rollout,
        rollout_is=is_cfg,
    )
