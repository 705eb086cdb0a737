"""Each role's `EngineSpec` and `UpdatePlan`, mapped from its own config section — the one place where roles meet
the role-free engine.

Decision: the actor/reference/critic/reward-model specs read `actor.*`, `ref.*`, `critic.*`, `reward.reward_model.*`;
SFT and RM read their `sft.*`/`rm.*` sections for batch sizes, optimizer and clipping, and reuse the actor's
(SFT) or critic's (RM) sharding/offload, token-budget and log-prob settings — exactly what they trained with when
they were built from a dressed-up actor/critic config.
"""

from __future__ import annotations

from dataclasses import replace

from hybridflow.config import Config
from hybridflow.config.resolved import RoleBatch
from hybridflow.config.schema import LoraConfig
from hybridflow.engine.model_forward import HeadRequest
from hybridflow.engine.spec import EngineSpec, MicroBatching, OptimizerSpec
from hybridflow.engine.update import UpdatePlan

# Reference log-probs use the default chunk (the ref section has no chunk-size key).
REF_LOGPROB_CHUNK = 1024


# ------------------------------------------------------------------------------------------------------ PPO roles
def actor_spec(cfg: Config, total_training_steps: int | None = None) -> EngineSpec:
    a = cfg.actor
    return EngineSpec(
        model=cfg.model, head="lm", fsdp=a.fsdp, packed=cfg.data.use_packed_dataset,
        train_batching=MicroBatching(a.ppo_micro_batch_size_per_gpu, a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu),
        infer_batching=MicroBatching(a.log_prob_micro_batch_size_per_gpu, a.use_dynamic_bsz,
                                     a.log_prob_max_token_len_per_gpu),
        optimizer=OptimizerSpec(a.optim, a.grad_clip, total_training_steps), lora=cfg.model.lora,
        routing_replay=a.moe.routing_replay, moe_aux_loss_coef=a.moe.aux_loss_coef,
        exact_logprobs=cfg.actor_rollout.exact_logprobs,
    )


def actor_head(cfg: Config, *, entropy: bool) -> HeadRequest:
    """Log-probs of the responses at the sampling temperature (training and old-log-prob passes)."""
    return HeadRequest("lm", cfg.rollout.temperature, cfg.actor.logprob_chunk_size, entropy)


def actor_plan(cfg: Config, batch: RoleBatch) -> UpdatePlan:
    a = cfg.actor
    return UpdatePlan(batch.mini_batch_samples_per_gpu, a.ppo_epochs, a.shuffle, cfg.model.seed)


def ref_spec(cfg: Config) -> EngineSpec:
    """The frozen reference model (not built with LoRA: the actor with its adapters disabled is the reference)."""
    r = cfg.ref
    return EngineSpec(model=cfg.model, head="lm", fsdp=r.fsdp, packed=cfg.data.use_packed_dataset,
                      infer_batching=MicroBatching(r.log_prob_micro_batch_size_per_gpu))


def ref_head(cfg: Config) -> HeadRequest:
    return HeadRequest("lm", cfg.rollout.temperature, REF_LOGPROB_CHUNK, False)


def teacher_spec(cfg: Config) -> EngineSpec:
    """On-policy distillation's frozen teacher: `teacher.model_path` (or the random-init `teacher.preset`), its own
    shape, so the student's `model.override_config` and LoRA do not apply; the student's tokenizer, dtype and kernels
    do (the teacher scores the student's token ids)."""
    t, m = cfg.teacher, cfg.model
    model = replace(m, path=t.model_path, preset=t.preset or m.preset, override_config={},
                    tokenizer_path=m.tokenizer_path or m.path, lora=LoraConfig())
    return EngineSpec(model=model, head="lm", fsdp=t.fsdp, packed=cfg.data.use_packed_dataset,
                      infer_batching=MicroBatching(t.log_prob_micro_batch_size_per_gpu))


def critic_spec(cfg: Config, total_training_steps: int | None = None) -> EngineSpec:
    c = cfg.critic
    batching = MicroBatching(c.ppo_micro_batch_size_per_gpu, c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu)
    return EngineSpec(model=cfg.model, head="value", fsdp=c.fsdp, packed=cfg.data.use_packed_dataset,
                      train_batching=batching, infer_batching=batching, model_path=c.model_path,
                      optimizer=OptimizerSpec(c.optim, c.grad_clip, total_training_steps), lora=cfg.model.lora)


def critic_plan(cfg: Config, batch: RoleBatch) -> UpdatePlan:
    c = cfg.critic
    return UpdatePlan(batch.mini_batch_samples_per_gpu, c.ppo_epochs, c.shuffle, cfg.model.seed)


def reward_model_spec(cfg: Config) -> EngineSpec:
    rm = cfg.reward.reward_model
    return EngineSpec(model=cfg.model, head="value", fsdp=rm.fsdp, packed=cfg.data.use_packed_dataset,
                      infer_batching=MicroBatching(rm.micro_batch_size_per_gpu), model_path=rm.path)


VALUES = HeadRequest("value")  # the scalar head at each response token's predecessor (critic)
SCORES = HeadRequest("score")  # the scalar head at each sequence's last valid token (reward model)


# ----------------------------------------------------------------------------------------------- supervised
def sft_spec(cfg: Config, total_steps: int | None, model_path: str | None) -> EngineSpec:
    """SFT: `sft.micro_batch_size_per_gpu` sequences per micro-batch, `sft.optim`/`grad_clip`; the actor's FSDP,
    token budget (`actor.use_dynamic_bsz`) and log-prob micro-batch."""
    s, a = cfg.sft, cfg.actor
    return EngineSpec(
        model=cfg.model, head="lm", fsdp=a.fsdp, packed=cfg.data.use_packed_dataset, model_path=model_path,
        train_batching=MicroBatching(s.micro_batch_size_per_gpu, a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu),
        infer_batching=MicroBatching(a.log_prob_micro_batch_size_per_gpu, a.use_dynamic_bsz,
                                     a.log_prob_max_token_len_per_gpu),
        optimizer=OptimizerSpec(s.optim, s.grad_clip, total_steps), lora=cfg.model.lora,
    )


def sft_head(cfg: Config) -> HeadRequest:
    return HeadRequest("lm", 1.0, cfg.actor.logprob_chunk_size, False)


def rm_spec(cfg: Config, total_steps: int | None, model_path: str | None) -> EngineSpec:
    """RM: rows are interleaved (chosen, rejected) pairs, so micro-batches hold 2 × `rm.micro_batch_size_per_gpu`
    rows, fixed (never by tokens: pairs stay whole); `rm.optim`/`grad_clip`; the critic's FSDP settings."""
    s = cfg.rm
    batching = MicroBatching(2 * s.micro_batch_size_per_gpu)
    return EngineSpec(model=cfg.model, head="value", fsdp=cfg.critic.fsdp, packed=cfg.data.use_packed_dataset,
                      train_batching=batching, infer_batching=batching, model_path=model_path,
                      optimizer=OptimizerSpec(s.optim, s.grad_clip, total_steps), lora=cfg.model.lora)


def dpo_spec(cfg: Config, total_steps: int | None, model_path: str | None) -> EngineSpec:
    """DPO: the policy, a causal LM; micro-batches of 2 × `dpo.micro_batch_size_per_gpu` rows, fixed (pairs stay
    whole, chosen and rejected in one forward); `dpo.optim`/`grad_clip`; the actor's FSDP settings."""
    s = cfg.dpo
    batching = MicroBatching(2 * s.micro_batch_size_per_gpu)
    return EngineSpec(model=cfg.model, head="lm", fsdp=cfg.actor.fsdp, packed=cfg.data.use_packed_dataset,
                      train_batching=batching, infer_batching=batching, model_path=model_path,
                      optimizer=OptimizerSpec(s.optim, s.grad_clip, total_steps), lora=cfg.model.lora)


def dpo_ref_spec(cfg: Config, model_path: str | None) -> EngineSpec:
    """DPO's frozen reference: the starting model (same path, or the same preset seed), the ref's FSDP settings."""
    return EngineSpec(model=cfg.model, head="lm", fsdp=cfg.ref.fsdp, packed=cfg.data.use_packed_dataset,
                      infer_batching=MicroBatching(2 * cfg.dpo.micro_batch_size_per_gpu), model_path=model_path)


def supervised_plan(rows_on_rank: int) -> UpdatePlan:
    """One optimizer step on the whole batch, rows in order (pairs stay whole)."""
    return UpdatePlan(rows_on_rank)
