"""verl's config key names, accepted in YAML files and overrides and rewritten to hybridflow's keys.

Each entry was checked for meaning, not only for name: verl's `ppo_mini_batch_size` counts prompts like ours,
`*_micro_batch_size_per_gpu` samples per GPU like ours, and verl's `trainer.save_freq=-1` (never save) is our
`trainer.checkpoint.save_freq=0`. A verl key without an equivalent is an error naming the key and why; a key whose
verl value matches what hybridflow always does (e.g. `reward_model.reward_manager=naive`) is accepted and
logged. Every mapping logs one line ("verl key X → hybridflow key Y"). The table is docs/verl-keys.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hybridflow.config.dotted import set_dotted

logger = logging.getLogger(__name__)

# Top-level sections that exist only in verl: every key under them is either in VERL_KEYS or an error.
VERL_ROOTS = ("actor_rollout_ref", "reward_model", "custom_reward_function")


class VerlKeyError(ValueError):
    """A verl key that hybridflow cannot honour; the message names the key and why."""


@dataclass(frozen=True)
class VerlKey:
    ours: str | None  # the hybridflow key; None = accepted, nothing to set (`value` checks it is a no-op)
    note: str = ""  # how the meaning compares (docs table, log line)
    value: Callable[[str, Any], Any] | None = None  # verl value → ours; raises VerlKeyError when it has no match
    last: bool = False  # applied after the rest of its layer (it decides over another key, whatever the order)


class _Skip(Exception):
    """The verl value asks for what hybridflow does by default: nothing to set."""


def _save_freq(key: str, value: Any) -> Any:
    return 0 if isinstance(value, int) and value < 0 else value  # verl: -1 never saves; ours: 0 never, -1 at end


def _rollout_name(key: str, value: Any) -> Any:
    if value in ("vllm", "sglang", "hybrid"):
        return "hybrid"
    if value == "hf":
        return "hf"
    raise VerlKeyError(f"verl key {key}={value!r}: hybridflow generates with its own engine (rollout.name=hybrid) "
                       "or transformers (hf); drop the key or use vllm/sglang/hf")


def _only(expected: Any, why: str) -> Callable[[str, Any], Any]:
    def check(key: str, value: Any) -> Any:
        if value != expected and str(value).lower() != str(expected).lower():
            raise VerlKeyError(f"verl key {key}={value!r} has no hybridflow equivalent: {why}; remove it "
                               f"(or set it to {expected!r})")
        return value
    return check


def _filter_overlong(key: str, value: Any) -> Any:
    if value in (True, "true", "True"):
        return "filter"
    raise _Skip


_ACTOR = ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
          "ppo_epochs", "shuffle", "grad_clip", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c",
          "loss_agg_mode", "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type", "tau_pos", "tau_neg")
_OPTIM = ("lr", "weight_decay", "betas", "lr_warmup_steps", "lr_warmup_steps_ratio", "min_lr_ratio")
_FSDP = ("param_offload", "optimizer_offload", "reshard_after_forward")
_ROLLOUT = ("n", "temperature", "top_k", "top_p", "do_sample", "ignore_eos", "free_cache_engine", "enforce_eager",
            "max_num_seqs", "max_num_batched_tokens")
_SAMPLES = "SAMPLES per GPU, as in verl"

VERL_KEYS: dict[str, VerlKey] = {
    # ---- model
    "actor_rollout_ref.model.path": VerlKey("model.path"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": VerlKey("model.enable_gradient_checkpointing",
                                                                     "one setting for actor, reference and critic"),
    "actor_rollout_ref.model.trust_remote_code": VerlKey("model.trust_remote_code"),
    "actor_rollout_ref.model.use_remove_padding": VerlKey("data.use_packed_dataset", "padding-free packed forwards"),
    "actor_rollout_ref.model.lora_rank": VerlKey("model.lora.rank"),
    "actor_rollout_ref.model.lora_alpha": VerlKey("model.lora.alpha"),
    "actor_rollout_ref.model.target_modules": VerlKey("model.lora.target_modules"),
    # ---- actor
    **{f"actor_rollout_ref.actor.{k}": VerlKey(f"actor.{k}") for k in _ACTOR},
    "actor_rollout_ref.actor.ppo_mini_batch_size": VerlKey("actor.ppo_mini_batch_size", "PROMPTS, global, as in verl"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": VerlKey("actor.ppo_micro_batch_size_per_gpu", _SAMPLES),
    "actor_rollout_ref.actor.policy_loss.loss_mode": VerlKey("actor.policy_loss", "a registered loss name"),
    **{f"actor_rollout_ref.actor.optim.{k}": VerlKey(f"actor.optim.{k}") for k in _OPTIM},
    "actor_rollout_ref.actor.optim.warmup_style": VerlKey("actor.optim.lr_scheduler", "constant | cosine"),
    "actor_rollout_ref.actor.optim.lr_scheduler_type": VerlKey("actor.optim.lr_scheduler", "constant | cosine"),
    **{f"actor_rollout_ref.actor.fsdp_config.{k}": VerlKey(f"actor.fsdp.{k}") for k in _FSDP},
    # ---- rollout
    **{f"actor_rollout_ref.rollout.{k}": VerlKey(f"rollout.{k}") for k in _ROLLOUT},
    "actor_rollout_ref.rollout.n": VerlKey("rollout.n", "responses per prompt"),
    "actor_rollout_ref.rollout.name": VerlKey("rollout.name", "vllm/sglang → our engine (hybrid)", _rollout_name),
    "actor_rollout_ref.rollout.gpu_memory_utilization": VerlKey(
        "rollout.gpu_memory_utilization", "ours: share of the memory free after the model loads, for the KV cache"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": VerlKey("rollout.tensor_model_parallel_size",
                                                                    "ranks of one generation group"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": VerlKey("actor.log_prob_micro_batch_size_per_gpu",
                                                                           _SAMPLES),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": VerlKey("actor.log_prob_max_token_len_per_gpu"),
    **{f"actor_rollout_ref.rollout.val_kwargs.{k}": VerlKey(f"rollout.val_kwargs.{k}")
       for k in ("n", "do_sample", "temperature", "top_k", "top_p")},
    **{f"actor_rollout_ref.rollout.multi_turn.{k}": VerlKey(f"rollout.multi_turn.{k}")
       for k in ("enable", "format", "max_assistant_turns", "max_user_turns", "tool_config_path",
                 "interaction_config_path")},
    # ---- reference
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": VerlKey("ref.log_prob_micro_batch_size_per_gpu",
                                                                       _SAMPLES),
    **{f"actor_rollout_ref.ref.fsdp_config.{k}": VerlKey(f"ref.fsdp.{k}") for k in _FSDP},
    # ---- critic (keys that differ; critic.ppo_*, critic.optim.*, critic.grad_clip ... are ours already)
    "critic.model.path": VerlKey("critic.model_path"),
    "critic.model.use_remove_padding": VerlKey("data.use_packed_dataset", "padding-free packed forwards"),
    "critic.model.enable_gradient_checkpointing": VerlKey("model.enable_gradient_checkpointing",
                                                          "one setting for actor, reference and critic"),
    **{f"critic.model.fsdp_config.{k}": VerlKey(f"critic.fsdp.{k}") for k in _FSDP},
    "critic.optim.warmup_style": VerlKey("critic.optim.lr_scheduler", "constant | cosine"),
    # ---- data / algorithm / trainer (keys that differ; the others are spelled the same)
    "data.filter_overlong_prompts": VerlKey("data.truncation", "true → filter (decides over data.truncation, "
                                            "as verl filters before truncating); false → data.truncation as given",
                                            _filter_overlong, last=True),
    "data.return_raw_chat": VerlKey(None, "accepted: prompts always stay chat messages for the rollout"),
    "data.dataloader_num_workers": VerlKey("data.num_workers"),
    "algorithm.norm_adv_by_std_in_grpo": VerlKey("algorithm.norm_adv_by_std", "false = Dr.GRPO"),
    "trainer.critic_warmup": VerlKey("critic.warmup_steps", "steps that train only the critic"),
    "trainer.save_freq": VerlKey("trainer.checkpoint.save_freq", "verl -1 (never) → 0; N → every N and the last",
                                 _save_freq),
    "trainer.max_actor_ckpt_to_keep": VerlKey("trainer.checkpoint.keep_last_n", "null = keep all"),
    # ---- reward
    "reward_model.enable": VerlKey("reward.reward_model.enable"),
    "reward_model.model.path": VerlKey("reward.reward_model.path"),
    "reward_model.micro_batch_size_per_gpu": VerlKey("reward.reward_model.micro_batch_size_per_gpu", _SAMPLES),
    "reward_model.reward_manager": VerlKey(None, "only naive: other managers are reward.* settings here",
                                           _only("naive", "the reward managers are reward.sources, "
                                                 "reward.overlong_buffer and reward.num_workers here")),
    "custom_reward_function.path": VerlKey("reward.custom.path"),
    "custom_reward_function.name": VerlKey("reward.custom.name"),
}

# verl keys met in its examples that hybridflow refuses, with the reason (anything else under VERL_ROOTS is refused
# with a pointer to the table).
NO_EQUIVALENT: dict[str, str] = {
    "actor_rollout_ref.actor.ppo_micro_batch_size": "verl's deprecated global micro-batch; set "
                                                    "actor.ppo_micro_batch_size_per_gpu (samples per GPU)",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": "no sequence parallelism (one sequence shard per GPU)",
    "actor_rollout_ref.rollout.mode": "verl's rollout server mode; the engine here is in-process (trainer.mode "
                                      "chooses sync / one_step_off / async training)",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "log-prob passes follow actor.use_dynamic_bsz",
    "actor_rollout_ref.actor.checkpoint.save_contents": "checkpoints always hold model, optimizer and extra state",
    "trainer.balance_batch": "no sequence-length balancing across ranks",
    "trainer.use_legacy_worker_impl": "one worker implementation",
    "critic.ulysses_sequence_parallel_size": "no sequence parallelism",
}


def is_verl_key(key: str) -> bool:
    return key in VERL_KEYS or key in NO_EQUIVALENT or key.split(".", 1)[0] in VERL_ROOTS


def translate(key: str, value: Any) -> tuple[str, Any] | None:
    """(hybridflow key, value) for verl's `key`, None when nothing is to be set; raises VerlKeyError."""
    if key in NO_EQUIVALENT:
        raise VerlKeyError(f"verl key {key} has no hybridflow equivalent: {NO_EQUIVALENT[key]}; remove it")
    entry = VERL_KEYS.get(key)
    if entry is None:
        raise VerlKeyError(f"verl key {key} has no hybridflow equivalent (docs/verl-keys.md lists the verl keys "
                           "accepted); remove it or use the hybridflow key from hybridflow/config/defaults.yaml")
    try:
        out = entry.value(key, value) if entry.value is not None else value
    except _Skip:
        logger.info("verl key %s=%r → nothing to set (%s)", key, value, entry.note)
        return None
    if entry.ours is None:
        logger.info("verl key %s=%r → nothing to set (%s)", key, value, entry.note)
        return None
    logger.info("verl key %s → hybridflow key %s%s", key, entry.ours, f" ({entry.note})" if entry.note else "")
    return entry.ours, out


def translate_overrides(items: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Dotted overrides with verl keys rewritten (in place of the original, or last for `VerlKey.last`)."""
    out, late = [], []
    for key, value in items:
        if not is_verl_key(key):
            out.append((key, value))
            continue
        pair = translate(key, value)
        if pair is not None:
            (late if VERL_KEYS[key].last else out).append(pair)
    return out + late


def translate_layer(layer: Mapping[str, Any]) -> dict[str, Any]:
    """A nested YAML layer with verl keys rewritten to hybridflow's (the result is a new dict)."""
    out: dict[str, Any] = {}
    pairs: list[tuple[str, Any]] = []
    for key, value in _leaves(layer, ""):
        if is_verl_key(key):
            pairs.append((key, value))
        else:
            set_dotted(out, key, value)
    for key, value in translate_overrides(pairs):
        set_dotted(out, key, value)
    return out


def _leaves(node: Mapping[str, Any], prefix: str) -> list[tuple[str, Any]]:
    """(dotted key, value) pairs; a mapping is descended only while its path can still lead to a verl key (so
    free-form mappings such as model.override_config stay whole)."""
    out = []
    for key, value in node.items():
        full = f"{prefix}{key}"
        if isinstance(value, Mapping) and value and _may_hold_verl_keys(full):
            out += _leaves(value, full + ".")
        else:
            out.append((full, value))
    return out


def _may_hold_verl_keys(path: str) -> bool:
    if path.split(".", 1)[0] in VERL_ROOTS:
        return True
    head = path + "."
    return any(k.startswith(head) for k in (*VERL_KEYS, *NO_EQUIVALENT))
