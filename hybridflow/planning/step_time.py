"""Predicted seconds per stage of a step: FLOPs / (peak FLOP/s × an MFU measured on one H200) for the passes, and
decode as bytes read / (copy bandwidth × a measured fraction of it). A prediction from three measured model sizes,
not a measurement: communication between GPUs is not modelled (data-parallel work is divided by the GPU count),
every row is assumed to generate `max_response_length` tokens (an upper bound unless `ignore_eos`), and the MFU and
bandwidth fractions measured on an H200 are assumed to carry over to other GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridflow.planning.memory import ADAM_BYTES, EngineSettings, RolloutSettings
from hybridflow.planning.model_shape import ModelShape, max_shard_numel


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float
    bf16_flops: float  # dense peak
    copy_bytes_per_s: float  # device-to-device copy bandwidth (H200: measured; others: spec × the H200 ratio)


H200_COPY_RATIO = 4.26 / 4.8  # measured copy (docs/benchmarks.md, "Decode kernels") / spec HBM bandwidth
GPUS = {
    "h200": Gpu("H200", 139.7, 989e12, 4.26e12),
    "h100": Gpu("H100-80GB SXM", 79.1, 989e12, 3.35e12 * H200_COPY_RATIO),
    "a100": Gpu("A100-80GB SXM", 79.1, 312e12, 2.04e12 * H200_COPY_RATIO),
}
PCIE_BYTES_PER_S = 20e9  # host <-> device for offload moves (assumed: PCIe 4/5 x16 effective; not measured here)

# Measured on one H200 (docs/benchmarks.md; workload 32 prompts x 8, 256 + 256 tokens). (params, value, source)
MEASURED = {
    "update_mfu": [
        (0.49e9, 0.427, "GRPO step vs TRL: 0.5B tuned, update MFU 42.7% (4313e64)"),
        (1.54e9, 0.519, "GRPO step vs TRL: 1.5B defaults, update MFU 51.9% (4313e64)"),
        (7.62e9, None, "LoRA and 7B: 7B LoRA update_actor 9.94 s (7826a95) -> MFU derived by `seven_b_mfu`"),
    ],
    "decode_fraction": [
        (0.49e9, 0.270, "Decode kernels: 0.5B 27.0% of the 4.26 TB/s copy roofline (4313e64)"),
        (1.54e9, 0.411, "Decode kernels: 1.5B 41.1% (4313e64)"),
        (7.62e9, None, "LoRA and 7B: 7B generate 2.49 s (7826a95) -> fraction derived by `seven_b_decode_fraction`"),
    ],
}
HOST_ADAM_S_PER_PARAM = 3.31 / 7.62e9  # 7B cpu_step: host AdamW 3.31 s for 7.62B parameters (7826a95, 16 cores)
SEVEN_B_UPDATE_S, SEVEN_B_GENERATE_S, SEVEN_B_TOKENS = 9.94, 2.49, 32 * 8 * 512


def train_flops(shape: ModelShape, tokens: int, seq: int, response_tokens: int) -> float:
    """engine/flops.py's count: 6·N·tokens + head on response tokens + causal attention (sequences of `seq`)."""
    n = shape.decoder_linear_params()
    head = shape.vocab * shape.hidden
    seqs = tokens / seq
    return 6.0 * (n * tokens + head * response_tokens) + 6.0 * shape.layers * shape.q_dim * seq * seq * seqs


def _interp(table: list[tuple[float, float | None, str]], params: float, seven_b: float) -> float:
    pts = sorted((p, v if v is not None else seven_b) for p, v, _ in table)
    x = math.log(params)
    if x <= math.log(pts[0][0]):
        return pts[0][1]
    for (p0, v0), (p1, v1) in zip(pts, pts[1:]):
        if x <= math.log(p1):
            w = (x - math.log(p0)) / (math.log(p1) - math.log(p0))
            return v0 + w * (v1 - v0)
    return pts[-1][1]


def _seven_b() -> ModelShape:
    """Qwen2.5-7B (models/presets.py's `qwen2.5-7b`, repeated here so the CLI's help does not import transformers)."""
    return ModelShape(layers=28, hidden=3584, heads=28, kv_heads=4, head_dim=128, inter=18944, vocab=152064,
                      tied=False, qkv_bias=True)


def update_factor(lora: bool, checkpointing: bool) -> float:
    """An update's FLOPs over 6·N·tokens: forward 2, input gradients 2, weight gradients 2 (none for a frozen LoRA
    base; the adapters' FLOPs are neglected), + 2 for the forward recomputed with gradient checkpointing."""
    return (6 - 2 * lora + 2 * checkpointing) / 6


def seven_b_mfu() -> float:
    """Hardware MFU of the 7B LoRA update (checkpointing on): its FLOPs as `predict_step_time` counts them."""
    flops = train_flops(_seven_b(), SEVEN_B_TOKENS, 512, SEVEN_B_TOKENS // 2) * update_factor(True, True)
    return flops / (SEVEN_B_UPDATE_S * 989e12)


def seven_b_decode_fraction() -> float:
    """The fraction of the copy roofline that makes the 7B generate 2.49 s after its prefill (at the 7B MFU)."""
    shape = _seven_b()
    prefill = train_flops(shape, 32 * 256, 256, 0) / 3 / (989e12 * seven_b_mfu())
    bytes_read = decode_bytes(shape, rows=256, prompt_len=256, response_len=256)
    return bytes_read / (GPUS["h200"].copy_bytes_per_s * (SEVEN_B_GENERATE_S - prefill))


def decode_bytes(shape: ModelShape, rows: int, prompt_len: int, response_len: int, b: int = 2) -> float:
    """Bytes a generation reads: every weight once a decode step + each row's KV (mean context P + R/2)."""
    weights = b * (shape.decoder_linear_params() + shape.vocab * shape.hidden)
    kv = rows * (prompt_len + response_len / 2) * shape.layers * 2 * shape.kv_dim * b
    return response_len * (weights + kv)


@dataclass(frozen=True)
class StepTime:
    seconds: dict[str, float]  # by stage
    mfu: float
    decode_fraction: float

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


def predict_step_time(engines: dict[str, EngineSettings], rollout: RolloutSettings, stages: list[str], gpu: Gpu,
                      samples_per_gpu: int) -> StepTime:
    """Seconds per stage on one of the data-parallel GPUs (they run the same work at once)."""
    actor = engines["actor"]
    shape, params = actor.shape, actor.shape.params()
    mfu = _interp(MEASURED["update_mfu"], params, seven_b_mfu())
    frac = _interp(MEASURED["decode_fraction"], params, seven_b_decode_fraction())
    seq = rollout.prompt_len + rollout.response_len
    tokens, resp = samples_per_gpu * seq, samples_per_gpu * rollout.response_len
    rate = gpu.bf16_flops * mfu
    out: dict[str, float] = {}
    prefill = train_flops(shape, rollout.prompts_per_gpu * rollout.prompt_len, rollout.prompt_len, 0) / 3 / rate
    out["generate"] = prefill + decode_bytes(shape, samples_per_gpu, rollout.prompt_len,
                                             rollout.response_len) / (gpu.copy_bytes_per_s * frac)
    for stage in stages:
        e = engines.get({"old_log_prob": "actor", "ref": "ref", "teacher": "teacher", "values": "critic",
                         "update_critic": "critic", "update_actor": "actor"}.get(stage, ""))
        if stage == "ref" and e is None:
            e = actor  # LoRA: the reference is the actor with adapters off
        if e is None or stage == "generate":
            continue
        flops = train_flops(e.shape, tokens, seq, resp if e.head == "lm" else 0)
        if stage.startswith("update"):
            flops *= update_factor(e.lora_rank > 0, e.checkpointing)
            secs = flops / rate + _offload_seconds(e)
        else:
            secs = flops / 3 / rate + (2 * e.param_bytes() / PCIE_BYTES_PER_S if e.param_offload else 0.0)
        out[stage] = secs
    return StepTime(seconds=out, mfu=mfu, decode_fraction=frac)


def _offload_seconds(e: EngineSettings) -> float:
    shard = max_shard_numel(e.trained_shapes(), e.world)
    if e.cpu_step:  # host AdamW; the gradients down and parameters up stream beside it (host_optim.py)
        return max(shard * HOST_ADAM_S_PER_PARAM, 2 * shard * e.compute_bytes / PCIE_BYTES_PER_S)
    secs = 2 * shard * ADAM_BYTES / PCIE_BYTES_PER_S if e.optimizer_offload else 0.0
    return secs + (2 * e.param_bytes() / PCIE_BYTES_PER_S if e.param_offload else 0.0)
