"""The settings that fit: a small grid over gradient checkpointing, optimizer offload, the training micro-batch,
parameter offload of the frozen engines (reference, teacher) and keeping the KV cache, scored by the predicted step
time; the fastest that fits wins (ties: the fewer changes, then the larger micro-batch). Printed as config overrides.

`fit_micro_batch` is the same search narrowed to the micro-batch, for code that sizes `auto` micro-batches; the
loader's `auto` (config/auto_sizes.py) still uses its calibrated rule.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from hybridflow.planning.from_config import PlanInputs, with_engine
from hybridflow.planning.memory import ADAM_BYTES, GiB, MemoryPlan, needed_bytes, plan_memory
from hybridflow.planning.step_time import Gpu, StepTime, predict_step_time

OFFLOADS: tuple[bool | str, ...] = (False, True, "cpu_step")
TRAINED = ("actor", "critic")
FROZEN = ("ref", "teacher")  # their parameter offload is searched together


class DoesNotFit(ValueError):
    """No setting of the grid fits the GPU; the message says what it needs and what to change."""


@dataclass(frozen=True)
class Choice:
    inputs: PlanInputs
    memory: MemoryPlan
    time: StepTime
    overrides: list[str]  # config keys that turn the given config into this choice (empty: it already is)


def evaluate(inputs: PlanInputs, gpu: Gpu) -> tuple[MemoryPlan, StepTime]:
    mem = plan_memory(inputs.engines, inputs.rollout, int(gpu.memory_gib * GiB), inputs.stages)
    return mem, predict_step_time(inputs.engines, inputs.rollout, inputs.stages, gpu, inputs.samples_per_gpu)


def _micro_tokens(inputs: PlanInputs, role: str) -> list[int]:
    """Training micro-batch sizes to try, in tokens: whole sequences, powers of two up to the per-GPU mini-batch."""
    e = inputs.engines[role]
    seq = inputs.rollout.prompt_len + inputs.rollout.response_len
    out, samples = [], 1
    while samples * seq <= max(e.train_tokens, seq) * 4 and samples <= inputs.samples_per_gpu:
        out.append(samples * seq)
        samples *= 2
    return sorted(set(out) | {e.train_tokens}, reverse=True)


def _candidates(inputs: PlanInputs) -> list[tuple[PlanInputs, dict[str, object]]]:
    """Every grid point as (inputs, what changed by config key)."""
    roles = [r for r in TRAINED if r in inputs.engines]
    actor = inputs.engines["actor"]
    ckpts = sorted({actor.checkpointing, True})
    # cpu_step: full fine-tuning with torch's AdamW only (not LoRA, not the low-bit optimizers)
    offloads = [o for o in OFFLOADS if not ((actor.lora_rank or actor.state_bytes != ADAM_BYTES) and o == "cpu_step")]
    frozen = [r for r in FROZEN if r in inputs.engines]
    ref_offloads = sorted({*(inputs.engines[r].param_offload for r in frozen), True}) if frozen else [None]
    frees = sorted({inputs.rollout.free_cache_engine, True})
    out = []
    for ckpt, off, tokens, ref_off, free in itertools.product(ckpts, offloads, _micro_tokens(inputs, "actor"),
                                                             ref_offloads, frees):
        cand, changes = inputs, {}
        for role in roles:
            e = cand.engines[role]
            new = {"checkpointing": ckpt, "optimizer_offload": off,
                   "train_tokens": min(tokens, e.train_tokens) if role == "critic" else tokens}
            cand = with_engine(cand, role, **new)
            if ckpt != e.checkpointing:
                changes["model.enable_gradient_checkpointing"] = ckpt
            if off != e.optimizer_offload:
                changes[f"{role}.fsdp.optimizer_offload"] = off
            if new["train_tokens"] != e.train_tokens:
                changes[f"{role}.micro_tokens"] = new["train_tokens"]
        for role in frozen:
            if ref_off != inputs.engines[role].param_offload:
                cand = with_engine(cand, role, param_offload=ref_off)
                changes[f"{role}.fsdp.param_offload"] = ref_off
        if free != inputs.rollout.free_cache_engine:
            cand = dataclasses.replace(cand, rollout=dataclasses.replace(cand.rollout, free_cache_engine=free))
            changes["rollout.free_cache_engine"] = free
        out.append((cand, changes))
    return out


def choose(inputs: PlanInputs, gpu: Gpu, dynamic: dict[str, bool] | None = None) -> Choice:
    """The fastest predicted grid point that fits `gpu`; `dynamic[role]`: the role batches by tokens (its
    micro-batch is printed as `<role>.ppo_max_token_len_per_gpu`, else as samples). Raises DoesNotFit."""
    best, smallest = None, None
    for cand, changes in _candidates(inputs):
        mem, time = evaluate(cand, gpu)
        need = needed_bytes(mem)
        if smallest is None or need < smallest[0]:
            smallest = (need, mem, changes)
        if need > gpu.memory_gib * GiB:
            continue
        key = (round(time.total, 3), len(changes), -cand.engines["actor"].train_tokens)
        if best is None or key < best[0]:
            best = (key, Choice(cand, mem, time, _overrides(changes, inputs, dynamic or {})))
    if best is None:
        need, mem, _ = smallest
        raise DoesNotFit(
            f"does not fit {gpu.memory_gib:.0f} GiB per GPU on {inputs.world} GPU(s) even with cpu_step, gradient "
            f"checkpointing and micro-batch 1: the {mem.peak.stage} stage needs {need / GiB:.1f} GiB (with "
            f"allocator and CUDA overhead); use LoRA (model.lora.rank=64) or more GPUs (trainer.n_gpus_per_node)")
    return best[1]


def fit_micro_batch(inputs: PlanInputs, gpu: Gpu, role: str = "actor") -> int:
    """The largest training micro-batch (tokens per GPU) of `role` that fits `gpu` with the other settings as they
    are; raises DoesNotFit when one sequence does not fit."""
    for tokens in _micro_tokens(inputs, role):
        cand = with_engine(inputs, role, train_tokens=tokens)
        if needed_bytes(evaluate(cand, gpu)[0]) <= gpu.memory_gib * GiB:
            return tokens
    raise DoesNotFit(f"{role}: not even one sequence per micro-batch fits {gpu.memory_gib:.0f} GiB; enable "
                     f"model.enable_gradient_checkpointing, {role}.fsdp.optimizer_offload=cpu_step or LoRA")


def _overrides(changes: dict[str, object], inputs: PlanInputs, dynamic: dict[str, bool]) -> list[str]:
    seq = inputs.rollout.prompt_len + inputs.rollout.response_len
    out = []
    for key, value in changes.items():
        if key.endswith(".micro_tokens"):
            role = key.split(".")[0]
            if dynamic.get(role):
                out.append(f"{role}.ppo_max_token_len_per_gpu={value}")
            else:
                out.append(f"{role}.ppo_micro_batch_size_per_gpu={max(1, int(value) // seq)}")
        else:
            out.append(f"{key}={str(value).lower()}")
    return sorted(out)
