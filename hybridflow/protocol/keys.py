"""The PPO batch contract: every key that flows between the stages of a step, declared once, and its checker.

Legend: B = rows (prompts before `gen`, prompts × rollout.n after), P = prompt width, R = response width,
L = P + R (model inputs after `gen`; P before). Names are verl's where verl has one (`old_log_probs`,
`ref_log_prob`, `values`, `advantages`, `returns`, `response_mask`, `token_level_scores`, `token_level_rewards`).
`meta_info` holds metadata only — sampling overrides for `gen` and the loader's position; results travel as keys
(worker timings are the one exception: `metrics`, per rank, merged by `DataProto.concat`).

Debug mode (`HYBRIDFLOW_CHECK_BATCH=1`, off by default): each `@checked_stage` method verifies that its batch
holds the keys the stage reads and, afterwards, that it wrote its keys — with consistent shapes and dtypes — and
that `meta_info` holds only declared metadata. An error names the stage, the key and the stage that writes it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Concatenate, Literal, ParamSpec, TypeVar

import numpy as np
import torch

from hybridflow.protocol.data_proto import DataProto

CHECK_ENV = "HYBRIDFLOW_CHECK_BATCH"

Kind = Literal["int", "float", "object"]  # integer/bool tensor | floating tensor | numpy object array (non-tensor)


class Key(str):
    """A batch key: the name itself (`batch[keys.RESPONSES]`, equal to and hashed as "responses"), plus its
    contract. A str, so code never spells a key twice (`.name` is the plain str). Pickles as a reference to the
    declaration; JSON, safetensors and f-strings see the plain name."""

    dims: tuple[str, ...]
    kind: Kind
    writer: str  # the stage (or `data`) that puts it in the batch
    doc: str

    def __new__(cls, name: str, dims: tuple[str, ...], kind: Kind, writer: str, doc: str) -> Key:
        key = super().__new__(cls, name)
        vars(key).update(dims=dims, kind=kind, writer=writer, doc=doc)
        return key

    @property
    def name(self) -> str:
        return str(self)

    def __setattr__(self, attr: str, value: object) -> None:
        raise AttributeError(f"batch key {self.name!r} is immutable (tried to set {attr})")

    def __reduce__(self) -> tuple[Callable[[str], Key], tuple[str]]:
        return declared, (self.name,)


def _k(name: str, dims: str, kind: Kind, writer: str, doc: str) -> Key:
    return Key(name, tuple(dims.split()) if dims else (), kind, writer, doc)


# ----------------------------------------------------------------------------------------------------- the keys
INPUT_IDS = _k("input_ids", "B L", "int", "data", "prompt tokens, left-padded; after gen prompt + response")
ATTENTION_MASK = _k("attention_mask", "B L", "int", "data", "1 on real tokens of input_ids")
POSITION_IDS = _k("position_ids", "B L", "int", "data", "positions of input_ids (0 at the first real token)")
SEEDS = _k("seeds", "B", "int", "data", "one sampling seed per prompt (the driver adds it before gen)")
PROMPTS = _k("prompts", "B P", "int", "gen", "the prompt part of input_ids")
RESPONSES = _k("responses", "B R", "int", "gen", "sampled tokens, right-padded")
RESPONSE_MASK = _k("response_mask", "B R", "int", "gen", "1 on real response tokens (the loss mask)")
ROLLOUT_LOG_PROBS = _k("rollout_log_probs", "B R", "float", "gen", "log-probs the sampler drew with (0 on pads)")
POLICY_VERSION = _k("policy_version", "B", "int", "gen",
                    "non-sync modes: the policy version (optimizer steps) of the weights that generated the row "
                    "(its oldest token's, when a partial rollout continued under newer weights)")
ROLLOUT_POLICY_VERSION = _k("rollout_policy_version", "B R", "int", "gen",
                            "non-sync modes: the policy version that sampled each response token (after the end: "
                            "the row's last)")
ROUTED_EXPERTS = _k("routed_experts", "B L moe_layers k", "int", "gen",
                    "MoE models, our engine: the experts each token of input_ids is routed to in each MoE layer "
                    "(`actor.moe.routing_replay` makes the trainer's forward use them)")
TURN_REWARDS = _k("turn_rewards", "B R", "float", "gen", "multi-turn: each turn's tool/interaction reward on its "
                  "last model token (added to token_level_scores)")
BASELINE_REWARDS = _k("baseline_rewards", "B", "float", "gen", "ReMax: the greedy response's reward per row")
RM_SCORES = _k("rm_scores", "B", "float", "reward", "reward-model score of each response")
TOKEN_LEVEL_SCORES = _k("token_level_scores", "B R", "float", "reward", "mixed reward at the last response token")
OLD_LOG_PROBS = _k("old_log_probs", "B R", "float", "old_log_prob", "log-probs of the sampling policy, recomputed")
ENTROPY = _k("entropy", "B R", "float", "old_log_prob", "per-token entropy of the sampling policy")
REF_LOG_PROB = _k("ref_log_prob", "B R", "float", "ref", "log-probs of the reference policy")
TEACHER_LOG_PROBS = _k("teacher_log_probs", "B R", "float", "teacher",
                       "on-policy distillation: the frozen teacher's log-probs of the sampled tokens")
VALUES = _k("values", "B R", "float", "values", "critic values before the update")
TOKEN_LEVEL_REWARDS = _k("token_level_rewards", "B R", "float", "adv", "token_level_scores, minus KL if in reward")
ADVANTAGES = _k("advantages", "B R", "float", "adv", "advantage estimates (0 on pads)")
RETURNS = _k("returns", "B R", "float", "adv", "value targets")
UID = _k("uid", "B", "object", "data", "prompt group id (responses of one prompt share it)")
DATA_SOURCE = _k("data_source", "B", "object", "data", "which scorer the row uses")
REWARD_MODEL = _k("reward_model", "B", "object", "data", "{'ground_truth': ..., 'style': ...}")
EXTRA_INFO = _k("extra_info", "B", "object", "data", "free-form row info passed to scorers")
MULTI_MODAL_INPUTS = _k("multi_modal_inputs", "B", "object", "data",
                        "vision-language prompts: the row's image tensors {'pixel_values': [patches, D], "
                        "'image_grid_thw': [images, 3]} ({} for a row without images; data/vision.py)")

KEYS: dict[str, Key] = {k.name: k for k in (
    INPUT_IDS, ATTENTION_MASK, POSITION_IDS, SEEDS, PROMPTS, RESPONSES, RESPONSE_MASK, ROLLOUT_LOG_PROBS,
    POLICY_VERSION, ROLLOUT_POLICY_VERSION, ROUTED_EXPERTS, TURN_REWARDS, BASELINE_REWARDS, RM_SCORES,
    TOKEN_LEVEL_SCORES, OLD_LOG_PROBS, ENTROPY, REF_LOG_PROB, TEACHER_LOG_PROBS, VALUES,
    TOKEN_LEVEL_REWARDS, ADVANTAGES, RETURNS, UID, DATA_SOURCE, REWARD_MODEL, EXTRA_INFO, MULTI_MODAL_INPUTS)}

# meta_info: metadata only (sampling overrides for gen, the loader's position, per-rank worker timings).
META_KEYS = frozenset({"n", "do_sample", "temperature", "top_k", "top_p", "max_new_tokens", "validate", "epoch",
                       "batch_in_epoch", "metrics"})

MODEL_INPUTS = (INPUT_IDS, ATTENTION_MASK, POSITION_IDS, RESPONSES)


def declared(name: str) -> Key:
    """The declared key called `name` (how a pickled key comes back)."""
    return KEYS[name]


# --------------------------------------------------------------------------------------------------- the stages
@dataclass(frozen=True)
class Stage:
    """`reads` must be present before the stage runs; `writes` are present after it (in its output DataProto, or
    in the batch it updates in place). `optional` keys are checked for shape/dtype only when present."""

    name: str
    reads: tuple[Key, ...]
    writes: tuple[Key, ...]
    optional: tuple[Key, ...] = ()


GEN = Stage("gen", (INPUT_IDS, ATTENTION_MASK), (PROMPTS, RESPONSES, RESPONSE_MASK, ROLLOUT_LOG_PROBS, INPUT_IDS,
                                                 ATTENTION_MASK, POSITION_IDS),
           optional=(POSITION_IDS, SEEDS, TURN_REWARDS, POLICY_VERSION, ROLLOUT_POLICY_VERSION, ROUTED_EXPERTS))
REWARD = Stage("reward", (RESPONSES, RESPONSE_MASK), (TOKEN_LEVEL_SCORES,),
               optional=(RM_SCORES, DATA_SOURCE, TURN_REWARDS))
REWARD_MODEL_SCORE = Stage("reward_model", MODEL_INPUTS, (RM_SCORES,))
OLD_LOG_PROB = Stage("old_log_prob", MODEL_INPUTS, (OLD_LOG_PROBS, ENTROPY))
OLD_FROM_ROLLOUT = Stage("old_from_rollout", (ROLLOUT_LOG_PROBS,), (OLD_LOG_PROBS,))  # exact log-probs, sync mode
REF = Stage("ref", MODEL_INPUTS, (REF_LOG_PROB,))
TEACHER = Stage("teacher", MODEL_INPUTS, (TEACHER_LOG_PROBS,))
VALUES_STAGE = Stage("values", MODEL_INPUTS, (VALUES,))
ADV = Stage("adv", (TOKEN_LEVEL_SCORES, RESPONSE_MASK, UID), (TOKEN_LEVEL_REWARDS, ADVANTAGES, RETURNS),
            optional=(OLD_LOG_PROBS, ROLLOUT_LOG_PROBS, REF_LOG_PROB, TEACHER_LOG_PROBS, VALUES, BASELINE_REWARDS))
UPDATE_CRITIC = Stage("update_critic", (*MODEL_INPUTS, RESPONSE_MASK, VALUES, RETURNS), ())
UPDATE_ACTOR = Stage("update_actor", (*MODEL_INPUTS, RESPONSE_MASK, ADVANTAGES), (),
                     optional=(OLD_LOG_PROBS, REF_LOG_PROB, ROLLOUT_LOG_PROBS))


# ------------------------------------------------------------------------------------------ shared batch readers
def sampling_log_probs(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Log-probs of the policy that sampled the responses, for KL measured on the driver: the recomputed
    `old_log_probs` when the `old_log_prob` stage ran, else the sampler's own `rollout_log_probs`. (The actor loss
    falls back differently — to its current log-probs, detached — so a strictly on-policy ratio is exactly 1.)"""
    return batch[OLD_LOG_PROBS] if OLD_LOG_PROBS in batch else batch[ROLLOUT_LOG_PROBS]


# ------------------------------------------------------------------------------------------------ debug checks
class BatchContractError(ValueError):
    """A stage's batch breaks the contract above (debug mode only)."""


def checks_enabled() -> bool:
    return os.environ.get(CHECK_ENV, "").strip().lower() not in ("", "0", "false", "no")


def check(stage: Stage, data: DataProto, when: Literal["in", "out"], before: set[str] | None = None) -> None:
    """Raise `BatchContractError` if `data` lacks a key `stage` reads (`in`) or writes (`out`), or if a declared
    key has the wrong kind or a shape inconsistent with the others (B rows, R response width, ...). `before`
    (`out` only): the keys of the stage's input; a key the stage added must be one it declares."""
    required = stage.reads if when == "in" else stage.writes
    present = _present(data)
    added = sorted(present - before - {*stage.reads, *stage.writes, *stage.optional}) if before is not None else []
    if added:
        raise BatchContractError(f"stage {stage.name!r} wrote {added}, which it does not declare; add them to its "
                                 "writes (and declare each Key) in hybridflow/protocol/keys.py")
    missing = [k for k in required if k not in present]
    if missing:
        where = ", ".join(f"{k!r} (written by {k.writer})" for k in missing)
        raise BatchContractError(f"stage {stage.name!r} ({when}put): batch lacks {where}; has {sorted(present)}")
    # Widths are anchored on the keys that define them, so an error names the key that disagrees.
    sizes: dict[str, int] = {"B": len(data)}
    for dim, anchor in (("R", RESPONSES), ("P", PROMPTS), ("L", INPUT_IDS)):
        if anchor in data.batch and data.batch[anchor].dim() == 2:
            sizes[dim] = data.batch[anchor].shape[1]
    for key in (*required, *stage.optional):
        if key in present:
            _check_key(stage, key, data, sizes)
    unknown = sorted(set(data.meta_info) - META_KEYS)
    if unknown:
        raise BatchContractError(f"stage {stage.name!r}: meta_info holds undeclared keys {unknown}; meta_info is "
                                 f"for metadata ({sorted(META_KEYS)}) — put per-row data in the batch")


def _present(data: DataProto) -> set[str]:
    return set(data.batch) | set(data.non_tensor_batch)


def _check_key(stage: Stage, key: Key, data: DataProto, sizes: dict[str, int]) -> None:
    value = data.batch.get(key)
    if value is None:
        value = data.non_tensor_batch[key]
        kind: Kind = "object"
    else:
        kind = "float" if value.is_floating_point() else "int"
    if kind != key.kind:
        raise BatchContractError(f"stage {stage.name!r}: {key!r} is {kind} ({_dtype(value)}), the contract "
                                 f"says {key.kind} ({key.doc})")
    shape = tuple(value.shape)
    if len(shape) != len(key.dims):
        raise BatchContractError(f"stage {stage.name!r}: {key!r} has shape {list(shape)}, the contract says "
                                 f"[{', '.join(key.dims)}]")
    for dim, size in zip(key.dims, shape):
        if sizes.setdefault(dim, size) != size:
            raise BatchContractError(f"stage {stage.name!r}: {key!r} has {dim}={size} but other keys have "
                                     f"{dim}={sizes[dim]} (shape {list(shape)} vs [{', '.join(key.dims)}])")


def _dtype(value: torch.Tensor | np.ndarray) -> str:
    return str(value.dtype)


def _checked_in(stage: Stage, data: DataProto) -> DataProto:
    check(stage, data, "in")
    return data


P = ParamSpec("P")
R = TypeVar("R")
S = TypeVar("S")


def checked_stage(stage: Stage) -> Callable[[Callable[Concatenate[S, DataProto, P], R]],
                                            Callable[Concatenate[S, DataProto, P], R]]:
    """Decorate a stage method `(self, batch, ...)`: in debug mode check `batch` against `stage.reads` before the
    call and, after it, the returned DataProto (or `batch`, when the stage updates it in place) against
    `stage.writes`, and that it added no key it does not declare. A call given `late` (`protocol/late.py`) has
    its inputs once the late columns arrive: the check reads the batch `late` returns. Off (the default), the
    method runs untouched."""

    def wrap(fn: Callable[Concatenate[S, DataProto, P], R]) -> Callable[Concatenate[S, DataProto, P], R]:
        @functools.wraps(fn)
        def inner(self: S, batch: DataProto, /, *args: P.args, **kwargs: P.kwargs) -> R:
            if not checks_enabled():
                return fn(self, batch, *args, **kwargs)
            before = _present(batch)
            late = kwargs.get("late")
            if callable(late):
                kwargs["late"] = lambda: _checked_in(stage, late())
            else:
                check(stage, batch, "in")
            out = fn(self, batch, *args, **kwargs)
            check(stage, out if isinstance(out, DataProto) else batch, "out", before)
            return out

        return inner

    return wrap
