"""Predicted GPU and host bytes per rank, per stage of a step (generate, old_log_prob, ref, teacher, values,
update_critic, update_actor), per component: a model of what the engines hold, written from engine/ and rollout/, not
a measurement.

Per engine (actor, critic, reference, distillation teacher; FSDP2 Shard(0) over `world` ranks, rank 0's share — the
largest):
- parameters: shard × master dtype (LoRA: frozen base in the compute dtype + fp32 adapters; cpu_step: compute
  dtype, the fp32 masters are on the host); off the GPU between its stages with `param_offload`.
- unsharded copy: FSDP2's all-gathered compute-dtype parameters. Kept after a forward on one rank or with
  `reshard_after_forward=false` (full model, resident from then on; the actor's is resharded for generation), else
  the root (embeddings, head) + two layers while a pass runs.
- gradients: shard × master dtype (cpu_step: compute dtype); with the deferred reduction (`defer_grad_sync`) the
  full unsharded trainable size in `reduce_dtype`, held across micro-batches (the larger of the two counts).
- optimizer: Adam's two moments, shard × 8 bytes, on the GPU unless `optimizer_offload` (true: there for the update
  only; cpu_step: never — host memory holds master + moments, 12 bytes a parameter).
Activations per micro-batch of T tokens, compute dtype b bytes (h hidden, kv = kv_heads·head_dim, I intermediate):
- one decoder layer saves, per token, b·(7h + 3kv + 3I) bytes with compiled layers (the GPU default): the two
  RMSNorm inputs and outputs, q/k/v and RoPE'd q/k, the attention output, gate, up and SiLU(gate)·up
  (FlashAttention-style kernels: no [s, s] scores). Eager: b·(7h + 3kv + 4I) + 8h (SiLU(gate) kept apart, fp32
  RMSNorm upcasts saved); not checked against a measurement.
- training: T·L·(that) without gradient checkpointing; with it T·(L·b·h + that) (each layer's input, plus one layer
  recomputed during backward). Forward only: T·b·(2h + q + 2kv + 2I), one layer's temporaries.
- logits: one chunk of `logprob_chunk_size` response tokens × vocab × 2b (the chunk's logits and their gradient,
  engine/logprobs.py), + the lm_head weight gradient buffer (vocab·h·4) when the head trains.
Rollout: KV cache = slots × round16(prompt + response) × layers × 2 × kv_heads × head_dim × b, slots = min(
`max_num_seqs`, `kv_cache_tokens` // length or `gpu_memory_utilization` × free memory // bytes per slot) as
rollout/kv_cache.py sizes it; the weight view = a compute-dtype copy of the weights unless one rank already holds
them in the compute dtype (LoRA: the adapted matrices are always copied); prefill = one layer's temporaries over the
prompt tokens (≤ max_num_batched_tokens). `rollout.quantization=fp8` adds the e4m3 copies of the decoder
projections made at each switch (rollout/fp8.py): 1 byte a q/k/v, o, gate/up and down weight element + one fp32 scale
per output channel, before the KV cache is sized. Kept between steps unless `free_cache_engine` (one rank keeps the
cast buffers even then; the fp8 copies go with the cache). Tensor-parallel generation (`tp` ranks a group): each
rank holds its weight slices (model_shape.tp_slice_numel, kept between steps: the resharder refills them in place)
and a cache of its KV heads (max(1, kv_heads // tp)); the group prefills and decodes its members' rows together
(tp × a rank's), each rank computing 1/tp of the heads, MLP rows and vocabulary. Peaks are torch's allocated
bytes; a GPU also needs `CUDA_CONTEXT_GIB` and the allocator's fragmentation (`FRAGMENTATION`) on top, which `fits`
adds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridflow.planning.model_shape import ModelShape, shard_numel, tp_slice_numel

GiB = 2**30
CUDA_CONTEXT_GIB = 1.0  # CUDA context + cuBLAS/NCCL workspaces outside torch's allocator (typ. 0.5-1.5 GiB)
FRAGMENTATION = 0.10  # reserved above allocated; 7B cpu_step measured 28% (119.7 vs 93.5), the small runs less
ADAM_BYTES = 8  # exp_avg + exp_avg_sq in fp32
STAGES = ("generate", "old_log_prob", "ref", "teacher", "values", "update_critic", "update_actor")


@dataclass(frozen=True)
class EngineSettings:
    """One FSDP2 engine as the planner sees it."""

    role: str  # actor | critic | ref | teacher
    shape: ModelShape
    head: str = "lm"  # lm | value
    trainable: bool = True
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    master_bytes: int = 4  # fsdp.param_dtype
    compute_bytes: int = 2  # model.dtype on GPU
    reduce_bytes: int = 4  # fsdp.reduce_dtype
    optimizer_offload: bool | str = False  # false | true | cpu_step
    state_bytes: float = ADAM_BYTES  # optimizer state per parameter (optim.optimizer: fp32 AdamW 8; 8-bit ~2)
    param_offload: bool = False
    reshard_after_forward: bool = True
    defer_grad_sync: bool | str = "auto"
    checkpointing: bool = False
    compiled: bool = True  # model.use_torch_compile (auto: on for a GPU)
    train_tokens: int = 4096  # tokens per training micro-batch per GPU
    infer_tokens: int = 16384  # tokens per forward-only micro-batch per GPU
    logprob_chunk: int = 4096
    world: int = 1
    rank: int = 0  # whose shard is counted: rank 0 holds the largest (torch.chunk gives the last ranks fewer rows)

    @property
    def cpu_step(self) -> bool:
        return self.trainable and self.optimizer_offload == "cpu_step"

    @property
    def keep_unsharded(self) -> bool:
        return self.world == 1 or not self.reshard_after_forward

    @property
    def deferred(self) -> bool:
        on = self.defer_grad_sync is True or (self.defer_grad_sync == "auto" and self.world == 1)
        return self.trainable and on and self.reduce_bytes >= self.master_bytes  # as engine/train_engine.py

    # ------------------------------------------------------------------------------------- states (bytes)
    def base_shapes(self) -> list[tuple[int, ...]]:
        return self.shape.param_shapes(self.head)

    def adapter_shapes(self) -> list[tuple[int, ...]]:
        return list(self.shape.lora_shapes(self.lora_rank, self.lora_targets)) if self.lora_rank else []

    def trained_shapes(self) -> list[tuple[int, ...]]:
        if not self.trainable:
            return []
        return self.adapter_shapes() if self.lora_rank else self.base_shapes()

    def _shard(self, shapes: list[tuple[int, ...]], world: int) -> int:
        return shard_numel(shapes, world, self.rank)

    def param_bytes(self) -> int:
        base = self._shard(self.base_shapes(), self.world)
        if self.lora_rank:
            return base * self.compute_bytes + self._shard(self.adapter_shapes(), self.world) * 4
        dtype = self.compute_bytes if self.cpu_step else self.master_bytes
        return base * dtype

    def grad_dtype_bytes(self) -> int:
        return 4 if self.lora_rank else (self.compute_bytes if self.cpu_step else self.master_bytes)

    def grad_bytes(self) -> int:
        sharded = self._shard(self.trained_shapes(), self.world) * self.grad_dtype_bytes()
        if not self.deferred:
            return sharded
        full = sum(_numel(s) for s in self.trained_shapes()) * self.reduce_bytes
        return max(sharded, full)

    def optimizer_gpu_bytes(self) -> int:
        if not self.trainable or self.cpu_step:
            return 0
        return int(self._shard(self.trained_shapes(), self.world) * self.state_bytes)

    def host_bytes(self) -> int:
        """Host memory this rank keeps for the engine: cpu_step masters + moments (+ 2 pinned 256 MB staging
        buffers); optimizer / parameter offload: what is parked there between uses."""
        shard = self._shard(self.trained_shapes(), self.world)
        out = 0
        if self.cpu_step:
            out += shard * (4 + ADAM_BYTES) + 2 * 256 * 2**20
        elif self.trainable and self.optimizer_offload:
            out += int(shard * self.state_bytes)
        if self.param_offload:
            out += self.param_bytes()
        return out

    def unsharded_bytes(self) -> int:
        full = sum(_numel(s) for s in self.base_shapes()) + sum(_numel(s) for s in self.adapter_shapes())
        if self.keep_unsharded:
            return full * self.compute_bytes
        s = self.shape
        layer = (sum(o * i for o, i in s.linear_shapes().values()) + 2 * s.hidden) * self.compute_bytes
        root = (s.vocab * s.hidden * (1 if s.tied or self.head == "value" else 2) + s.hidden) * self.compute_bytes
        return root + 2 * layer

    # ------------------------------------------------------------------------------------- activations
    def layer_saved_per_token(self) -> int:
        s, b = self.shape, self.compute_bytes
        if self.compiled:  # inductor: SiLU(gate)·up fused, RMSNorm's fp32 upcast recomputed in backward
            return b * (7 * s.hidden + 3 * s.kv_dim + 3 * s.inter)
        return b * (7 * s.hidden + 3 * s.kv_dim + 4 * s.inter) + 8 * s.hidden

    def train_activation_bytes(self) -> int:
        s, t = self.shape, self.train_tokens
        if self.checkpointing:
            acts = t * (s.layers * self.compute_bytes * s.hidden + self.layer_saved_per_token())
        else:
            acts = t * s.layers * self.layer_saved_per_token()
        return acts + self.logits_bytes(t, grad=True)

    def infer_activation_bytes(self) -> int:
        s, t = self.shape, self.infer_tokens
        layer = t * self.compute_bytes * (2 * s.hidden + s.q_dim + 2 * s.kv_dim + 2 * s.inter)
        return layer + self.logits_bytes(t, grad=False)

    def logits_bytes(self, tokens: int, grad: bool) -> int:
        if self.head != "lm":
            return tokens * 4
        block = min(self.logprob_chunk, tokens) * self.shape.vocab * 2 * self.compute_bytes
        head_trains = grad and self.trainable and not self.lora_rank
        return block + (self.shape.vocab * self.shape.hidden * 4 if head_trains else 0)


@dataclass(frozen=True)
class RolloutSettings:
    prompt_len: int
    response_len: int
    rows_per_gpu: int  # samples generated per GPU per step
    prompts_per_gpu: int
    max_num_seqs: int = 256
    kv_cache_tokens: int | None = None
    gpu_memory_utilization: float = 0.5
    max_num_batched_tokens: int = 16384
    free_cache_engine: bool = True
    tp: int = 1  # rollout.tensor_model_parallel_size
    quantization: str = "none"  # rollout.quantization: none | fp8

    @property
    def max_len(self) -> int:
        return -(-(self.prompt_len + self.response_len) // 16) * 16


@dataclass(frozen=True)
class StagePeak:
    stage: str
    components: dict[str, int]  # bytes by component name

    @property
    def total(self) -> int:
        return sum(self.components.values())


@dataclass(frozen=True)
class MemoryPlan:
    stages: list[StagePeak]
    host_bytes: int  # per rank
    kv_slots: int
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> StagePeak:
        return max(self.stages, key=lambda s: s.total)

    def stage(self, name: str) -> StagePeak:
        return next(s for s in self.stages if s.stage == name)


def kv_bytes_per_slot(shape: ModelShape, rollout: RolloutSettings, b: int) -> int:
    kv_heads = max(1, shape.kv_heads // rollout.tp)  # a tensor-parallel rank caches its own KV heads
    return rollout.max_len * shape.layers * 2 * kv_heads * shape.head_dim * b


def kv_slots(shape: ModelShape, rollout: RolloutSettings, b: int, free_bytes: int) -> int:
    """rollout/kv_cache.py's `plan_slots` on a GPU with `free_bytes` free when the cache is allocated."""
    per = kv_bytes_per_slot(shape, rollout, b)
    fit = (rollout.kv_cache_tokens // (rollout.prompt_len + rollout.response_len) if rollout.kv_cache_tokens
           else int(free_bytes * rollout.gpu_memory_utilization) // per)
    return max(0, min(rollout.max_num_seqs, fit))


def weight_view_bytes(actor: EngineSettings, tp: int = 1) -> int:
    """The rollout's compute-dtype weights: this rank's slices with tensor-parallel generation, none when one rank
    already holds them in that dtype (zero-copy views), the adapted matrices with LoRA on one rank, else a full copy."""
    if tp > 1:
        return tp_slice_numel(actor.shape, tp) * actor.compute_bytes
    full = sum(_numel(s) for s in actor.base_shapes()) * actor.compute_bytes
    same_dtype = actor.lora_rank or actor.cpu_step or actor.master_bytes == actor.compute_bytes
    if actor.world == 1 and same_dtype:
        if not actor.lora_rank:
            return 0
        s = actor.shape
        adapted = sum(o * i for n, (o, i) in s.linear_shapes().items() if n in actor.lora_targets)
        return s.layers * adapted * actor.compute_bytes
    return full


def fp8_weight_bytes(shape: ModelShape) -> int:
    """The fp8 rollout's copies of the decoder projections (rollout/fp8.py `Fp8Weights`): 1 byte a weight element of
    q/k/v, o, gate/up and down, + 4 bytes a row (the fp32 per-output-channel scales). The fused q/k/v bias some models
    get on top (compute dtype, (q + 2 kv) a layer) is left out: under a MB."""
    linears = shape.linear_shapes().values()
    return shape.layers * sum(o * i + 4 * o for o, i in linears)


FP8_NOTE = ("rollout/fp8_weights: the e4m3 copies of the decoder projections made at each switch "
            "(rollout.quantization=fp8): 1 byte a weight element + fp32 scales, one per output channel")


def plan_memory(engines: dict[str, EngineSettings], rollout: RolloutSettings, gpu_bytes: int,
                stages: tuple[str, ...] | list[str] = STAGES) -> MemoryPlan:
    """Per-stage peaks on one GPU of `gpu_bytes` for `engines` (actor required; critic, ref, teacher optional) over the
    `stages` a step runs."""
    actor = engines["actor"]
    resting: dict[str, int] = {}
    for name, e in engines.items():
        resting[f"{name}/params"] = 0 if e.param_offload else e.param_bytes()
        resting[f"{name}/optimizer"] = 0 if e.optimizer_offload else e.optimizer_gpu_bytes()
        resting[f"{name}/unsharded"] = e.unsharded_bytes() if e.keep_unsharded and not e.param_offload else 0
        if name != "actor" and e.trainable:  # a critic's gradients stay until its next accumulation starts (the
            resting[f"{name}/gradients"] = e.grad_bytes()  # actor's are freed at the switch to generation)
    tp = rollout.tp
    view = weight_view_bytes(actor, tp)
    keep_view = not rollout.free_cache_engine or actor.world == 1 or tp > 1
    gen_base = {k: v for k, v in resting.items() if k != "actor/unsharded"}
    if actor.optimizer_offload:
        gen_base["actor/optimizer"] = 0
    gen_base["actor/params"] = actor.param_bytes()
    fp8 = fp8_weight_bytes(actor.shape) if rollout.quantization == "fp8" else 0
    free = gpu_bytes - int(CUDA_CONTEXT_GIB * GiB) - sum(gen_base.values()) - view - fp8
    slots = kv_slots(actor.shape, rollout, actor.compute_bytes, free)
    kv = slots * kv_bytes_per_slot(actor.shape, rollout, actor.compute_bytes)
    s = actor.shape
    prefill_tokens = min(rollout.max_num_batched_tokens, tp * rollout.prompts_per_gpu * rollout.prompt_len)
    kv_dim = max(1, s.kv_heads // tp) * s.head_dim
    prefill = prefill_tokens * actor.compute_bytes * (2 * s.hidden + s.q_dim // tp + 2 * kv_dim + 2 * s.inter // tp)
    # last-position logits (fp32) of a decode step: this rank's vocabulary shard
    prefill += min(tp * rollout.rows_per_gpu, slots) * -(-s.vocab // tp) * 4
    peaks = [StagePeak("generate", {**gen_base, "rollout/weights": view, "rollout/fp8_weights": fp8,
                                     "rollout/kv_cache": kv, "activations": prefill})]
    kept = {"rollout/weights": view if keep_view else 0, "rollout/kv_cache": 0 if rollout.free_cache_engine else kv,
            "rollout/fp8_weights": 0 if rollout.free_cache_engine else fp8}  # released with the cache

    actor_gathered = False  # generation reshards the actor: its unsharded copy is back after its next pass

    def pass_peak(stage: str, e: EngineSettings, role: str, train: bool) -> StagePeak:
        comp = dict(resting) | kept
        if not actor_gathered:
            comp["actor/unsharded"] = 0
        comp[f"{role}/params"] = e.param_bytes()
        comp[f"{role}/unsharded"] = e.unsharded_bytes()
        if train:
            comp[f"{role}/gradients"] = e.grad_bytes()
            comp[f"{role}/optimizer"] = e.optimizer_gpu_bytes()
            comp["activations"] = e.train_activation_bytes()
        else:
            comp["activations"] = e.infer_activation_bytes()
        return StagePeak(stage, comp)

    runs = {"old_log_prob": ("actor", False), "ref": ("ref" if "ref" in engines else "actor", False),
            "teacher": ("teacher", False), "values": ("critic", False), "update_critic": ("critic", True),
            "update_actor": ("actor", True)}
    for stage in stages:
        if stage in runs and runs[stage][0] in engines:
            role, train = runs[stage]
            peaks.append(pass_peak(stage, engines[role], role, train))
            actor_gathered = actor_gathered or role == "actor"
    host = sum(e.host_bytes() for e in engines.values())
    return MemoryPlan(stages=peaks, host_bytes=host, kv_slots=slots, notes=[FP8_NOTE] if fp8 else [])


def fits(plan: MemoryPlan, gpu_bytes: int) -> bool:
    return needed_bytes(plan) <= gpu_bytes


def needed_bytes(plan: MemoryPlan) -> int:
    """The GPU memory the peak needs with the allocator's fragmentation and the CUDA context."""
    return int(plan.peak.total * (1 + FRAGMENTATION) + CUDA_CONTEXT_GIB * GiB)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
