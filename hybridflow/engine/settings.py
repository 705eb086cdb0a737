"""One flat view of the role config the engine needs (actor, critic, ref and reward configs differ in fields).

Decision: the engine reads only `RoleSettings`; mapping each role's config onto it happens here, once.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.schema import (
    ActorConfig,
    CriticConfig,
    FSDPConfig,
    OptimConfig,
    RefConfig,
    RewardModelConfig,
)

ENGINE_ROLES = ("actor", "critic", "ref", "reward")
RoleConfig = ActorConfig | CriticConfig | RefConfig | RewardModelConfig


@dataclass(frozen=True)
class RoleSettings:
    trainable: bool
    optim: OptimConfig | None
    fsdp: FSDPConfig
    grad_clip: float
    mini_batch_prompts: int  # global PROMPTS per optimizer step
    micro_batch_size: int  # SAMPLES per training micro-batch
    infer_micro_batch_size: int  # SAMPLES per log-prob/value micro-batch
    use_dynamic_bsz: bool
    max_token_len: int  # TOKENS per training micro-batch (dynamic)
    infer_max_token_len: int  # TOKENS per log-prob/value micro-batch (dynamic)
    ppo_epochs: int
    shuffle: bool
    loss_agg_mode: str
    logprob_chunk_size: int
    entropy_coeff: float


def role_settings(role_cfg: RoleConfig, role: str) -> RoleSettings:
    if role not in ENGINE_ROLES:
        raise ValueError(f"role={role!r}: must be one of {', '.join(ENGINE_ROLES)}")
    c = role_cfg
    if isinstance(c, ActorConfig):
        return RoleSettings(
            trainable=role == "actor", optim=c.optim, fsdp=c.fsdp, grad_clip=c.grad_clip,
            mini_batch_prompts=c.ppo_mini_batch_size, micro_batch_size=c.ppo_micro_batch_size_per_gpu,
            infer_micro_batch_size=c.log_prob_micro_batch_size_per_gpu, use_dynamic_bsz=c.use_dynamic_bsz,
            max_token_len=c.ppo_max_token_len_per_gpu, infer_max_token_len=c.log_prob_max_token_len_per_gpu,
            ppo_epochs=c.ppo_epochs, shuffle=c.shuffle, loss_agg_mode=c.loss_agg_mode,
            logprob_chunk_size=c.logprob_chunk_size, entropy_coeff=c.entropy_coeff,
        )
    if isinstance(c, CriticConfig):
        return RoleSettings(
            trainable=role == "critic", optim=c.optim, fsdp=c.fsdp, grad_clip=c.grad_clip,
            mini_batch_prompts=c.ppo_mini_batch_size, micro_batch_size=c.ppo_micro_batch_size_per_gpu,
            infer_micro_batch_size=c.ppo_micro_batch_size_per_gpu, use_dynamic_bsz=c.use_dynamic_bsz,
            max_token_len=c.ppo_max_token_len_per_gpu, infer_max_token_len=c.ppo_max_token_len_per_gpu,
            ppo_epochs=c.ppo_epochs, shuffle=c.shuffle, loss_agg_mode=c.loss_agg_mode,
            logprob_chunk_size=1024, entropy_coeff=0.0,
        )
    if role in ("actor", "critic"):
        raise ValueError(f"role={role!r} trains and needs an ActorConfig/CriticConfig, got {type(c).__name__}")
    micro = c.log_prob_micro_batch_size_per_gpu if isinstance(c, RefConfig) else c.micro_batch_size_per_gpu
    return RoleSettings(
        trainable=False, optim=None, fsdp=c.fsdp, grad_clip=1.0, mini_batch_prompts=1, micro_batch_size=micro,
        infer_micro_batch_size=micro, use_dynamic_bsz=False, max_token_len=0, infer_max_token_len=0,
        ppo_epochs=1, shuffle=False, loss_agg_mode="token-mean", logprob_chunk_size=1024, entropy_coeff=0.0,
    )
