"""Rollout: our own generation engine running on the actor's parameters (hybrid engine).

`RolloutEngine` (engine.py) → `Scheduler` (continuous batching) → `ModelRunner` (slot state, CUDA graphs) →
`forward` (Llama-family prefill/decode) + `sampling` (on-device sampler, chosen by the engine with
`build_sampler`); `hf_fallback` for other architectures.
"""

from hybridflow.rollout.engine import RolloutEngine, build_rollout
from hybridflow.rollout.sampling import SamplingParams

__all__ = ["RolloutEngine", "SamplingParams", "build_rollout"]
