"""`TrainEngine`: one FSDP2 module (causal LM or scalar head) with, when trained, its optimizer and LR schedule.

Decisions: the engine is built from an `EngineSpec` and knows no roles; callers say what to compute (a
`HeadRequest`) and how to score it (a `LossFn`). Inputs use verl's layout (see `packing.py`) and outputs are
[B, R] aligned with `responses`; forward passes are packed by default. `forward_backward` accumulates one
mini-batch's gradients over micro-batches, with the caller's `loss_fn` returning each micro-batch's share of the
mini-batch loss (global token normaliser), so gradients are summed — never averaged — over micro-batches and
data-parallel ranks; `step` clips and applies them (a non-finite gradient norm or loss skips the step). Epochs ×
mini-batches live in `engine/update.py`. torch.distributed must be initialised (world size 1 is fine).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from hybridflow.algorithms.aggregation import LOSS_AGG_MODES, loss_normalizer
from hybridflow.data.vision import batch_vision_inputs, vision_column
from hybridflow.engine import checkpoint as ckpt
from hybridflow.engine import invariant
from hybridflow.engine.attention import register as register_attention
from hybridflow.engine.compile import compile_layers, wants_compile
from hybridflow.engine.flops import FlopsCounter
from hybridflow.engine.fsdp import (
    DTYPES,
    apply_fsdp2,
    build_mesh,
    decoder_layers,
    move_model,
    move_optimizer,
    resolve_dtype,
)
from hybridflow.engine.host_optim import HostOptimizer, cast_params, cut_masters
from hybridflow.engine.lora import adapters_disabled, apply_lora
from hybridflow.engine.micro_batch import fixed_micro_batches, token_budget_micro_batches
from hybridflow.engine.model_forward import HeadRequest, install_engine_forward, trainable_tower_params
from hybridflow.engine.moe_aux import AUX_LOSS, load_balancing_loss, router_logits
from hybridflow.engine.moe_aux import METRIC as AUX_METRIC
from hybridflow.engine.moe_aux import check_model as check_moe_aux
from hybridflow.engine.moe_replay import AGREEMENT, ROUTED, routing_replay
from hybridflow.engine.optim import build_lr_scheduler, build_optimizer, is_fused
from hybridflow.engine.optim import set_kind as set_optimizer_kind
from hybridflow.engine.packing import build_inputs, scatter_to_responses
from hybridflow.engine.spec import EngineSpec, MicroBatching
from hybridflow.models.loader import load_module, load_tokenizer
from hybridflow.protocol import DataProto, keys
from hybridflow.protocol.late import new_columns
from hybridflow.utils.progress import beat

logger = logging.getLogger(__name__)
MODES = ("train", "generate", "offload")
INPUT_KEYS = keys.MODEL_INPUTS


class LossFn(Protocol):
    """What `forward_backward` calls per micro-batch, implemented by every trained role's loss: the actor's
    (`workers/losses.py` `ActorLoss`: PPO/GRPO), the critic's, and the supervised ones (SFT, reward model,
    DPO/IPO/SimPO: `workers/supervised_losses.py`)."""

    def __call__(self, outputs: dict[str, torch.Tensor], mb: DataProto,
                 global_norm: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor | float]]:
        """outputs: the engine's outputs for one micro-batch (`log_probs`, `entropy` or `values` [b, R]); mb: that
        micro-batch on the device; global_norm[loss_agg_mode]: the whole mini-batch's normaliser over all ranks.
        Returns this micro-batch's share of the mini-batch loss and metrics (shares or micro-batch means)."""
        ...


@dataclass(frozen=True)
class BackwardStats:
    """What one `forward_backward` did: the loss function's metrics averaged over micro-batches, tokens, FLOPs."""

    metrics: dict[str, torch.Tensor | float]  # device scalars stay on the device (`host_floats` reads them)
    num_tokens: int
    flops: float


class TrainEngine:
    """FSDP2 training/inference engine for one module built from `spec`. `module` is the FSDP2-wrapped HF model."""

    def __init__(self, spec: EngineSpec, *, device: str | torch.device | None = None) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("TrainEngine needs torch.distributed initialised (world size 1 is fine: "
                               "dist.init_process_group('gloo' or 'nccl', ...))")
        self.spec = spec
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
        self.compute_dtype = resolve_dtype(spec.model.dtype, self.device)
        self.dp_size, self.dp_rank = dist.get_world_size(), dist.get_rank()
        self.global_step = 0  # completed updates (LR-schedule steps)
        fsdp = spec.fsdp

        # LoRA: the frozen base is held in the compute dtype (no fp32 master, no optimizer state for it).
        base_dtype = self.compute_dtype if spec.uses_lora else DTYPES[fsdp.param_dtype]
        model = load_module(spec.model, spec.head, path=spec.model_path, dtype=base_dtype,
                            attn_implementation=register_attention(), init_device=self.device)
        check_moe_aux(model, spec.moe_aux_loss_coef)
        if spec.trainable and spec.model.enable_gradient_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if not spec.trainable:
            model.requires_grad_(False)
        # adapted leaf names (None = full fine-tuning); adapters are fp32 masters, only they (and a scalar head) train
        self.lora_targets = apply_lora(model, spec.lora, spec.model.seed) if spec.uses_lora else None
        model.to(self.device)
        if spec.exact_logprobs:  # before FSDP2 wraps the modules; compiled layers would fuse other roundings
            invariant.install(model)
        elif wants_compile(spec.model.use_torch_compile, self.device):
            compile_layers(decoder_layers(model))
        reduce_dtype, master_dtype = DTYPES[fsdp.reduce_dtype], DTYPES[fsdp.param_dtype]
        masters = None
        if fsdp.cpu_step and spec.trainable:  # full-precision copies to the host, compute dtype on the device
            masters = cut_masters(model, master_dtype, self.dp_rank, self.dp_size)
            cast_params(model, self.compute_dtype)
        elif fsdp.cpu_step:
            logger.warning("fsdp.optimizer_offload=cpu_step ignored: this engine is not trained (no optimizer)")
        apply_fsdp2(model, build_mesh(self.device), self.compute_dtype, reduce_dtype, fsdp.reshard_after_forward)
        # Deferring the gradient reduction to a mini-batch's last micro-batch accumulates in reduce_dtype; only
        # when that is at least as wide as the master weights is it the same sum (bf16 reduce + fp32 master: no).
        defer = fsdp.defer_grad_sync
        self._defer_grad_sync = ((defer is True or (defer == "auto" and self.dp_size == 1))
                                 and reduce_dtype.itemsize >= master_dtype.itemsize)
        install_engine_forward(model)
        self.module = model
        self._trains_tower = bool(trainable_tower_params(model))  # a vision-language model training its tower
        self.tokenizer = load_tokenizer(spec.model)
        adapters = None if self.lora_targets is None else sum(
            p.numel() for p in model.parameters() if p.requires_grad)
        self.flops = FlopsCounter(model.config, with_lm_head=spec.head == "lm", adapter_params=adapters)
        self.optimizer = self.lr_scheduler = None
        self.host_optimizer: HostOptimizer | None = None  # fsdp.optimizer_offload=cpu_step
        if masters is not None:
            self.host_optimizer = HostOptimizer(model, masters, spec.optimizer.optim,
                                                fused=_wants_fused_optimizer(self.device))
            self.optimizer = self.host_optimizer.optimizer  # over the host masters
        elif spec.optimizer is not None:
            self.optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], spec.optimizer.optim,
                                             fused=_wants_fused_optimizer(self.device))
        if self.optimizer is not None:
            self.lr_scheduler = build_lr_scheduler(self.optimizer, spec.optimizer.optim, spec.optimizer.total_steps)
        self._params_on_device = self._optim_on_device = True
        self._training = False  # inside `training()`
        self._train_micro_override: int | None = None  # set once by an out-of-memory retry (forward_backward)
        self._pending_loss: torch.Tensor | None = None  # summed loss shares since the last `step`
        self.to_rest()  # start offloaded where configured

    # ----------------------------------------------------------------------------------------- placement
    def to_mode(self, mode: str) -> None:
        """train / generate: weights on the device, the optimizer state too unless `optimizer_offload` (then on the
        CPU until an update needs it: `training()` brings it back, after the log-prob passes); generate also frees the
        gradients; offload: everything on CPU."""
        if mode not in MODES:
            raise ValueError(f"mode={mode!r}: must be one of {', '.join(MODES)}")
        if self.optimizer is not None and mode != "train":
            self._zero_grad()
        self._place(params=mode != "offload", optim=mode != "offload" and not self.spec.fsdp.optimizer_offload)

    def _place(self, params: bool, optim: bool) -> None:
        if self.device.type == "cpu":
            return
        cpu = torch.device("cpu")
        if params != self._params_on_device:
            move_model(self.module, self.device if params else cpu)
            self._params_on_device = params
        if self.optimizer is not None and self.host_optimizer is None and optim != self._optim_on_device:
            move_optimizer(self.optimizer, self.device if optim else cpu)
            self._optim_on_device = optim
        if not (params and optim):
            torch.cuda.empty_cache()

    def _enter(self, optim: bool) -> None:
        self._place(params=True, optim=optim or self._optim_on_device)

    def _prefetch_optimizer(self) -> None:
        """Bring the parked optimizer state (`optimizer_offload=true`) back for the update, after the log-prob passes.
        Synchronous: the side-stream copy that overlapped the first micro-batches was taken out after a GPU test
        found its result differing from state kept on the device (and `record_stream` failing on DTensor state)."""
        self._enter(optim=True)

    def to_rest(self) -> None:
        """Back to the resting placement after an operation: on the CPU whatever `fsdp.param_offload` /
        `optimizer_offload` ask for (checkpoint loads and saves, forward passes and steps end here)."""
        f = self.spec.fsdp
        self._place(params=not f.param_offload, optim=self._optim_on_device and not f.optimizer_offload)

    # ----------------------------------------------------------------------------------------- forward
    def _forward_micro(self, batch: dict[str, torch.Tensor], req: HeadRequest,
                       images: Sequence[dict[str, torch.Tensor]] | None = None, idle_tower: bool = False,
                       moe_aux: bool = False, replay_scope: contextlib.ExitStack | None = None,
                       ) -> tuple[dict[str, torch.Tensor], int]:
        """Outputs [b, R] (or [b] for scores) for one micro-batch; also its number of tokens. `images`: each row's
        `multi_modal_inputs` (vision-language models). `idle_tower`: another rank trains on images (a micro-batch
        without any gives the vision tower a zero gradient, `model_forward.idle_tower_zero`). `moe_aux`: also the
        routers' load-balancing loss over the micro-batch's real tokens, a scalar under `AUX_LOSS`
        (engine/moe_aux.py). `replay_scope`: MoE routing replay stays on until this closes — training closes it
        after the micro-batch's backward, whose checkpointed layers run again (engine/moe_replay.py); None: the
        forward only."""
        ids = batch[keys.INPUT_IDS]
        b, r = ids.shape[0], batch[keys.RESPONSES].shape[1]
        vision = batch_vision_inputs(images, ids, getattr(self.module.config, "image_token_id", None))
        # Indices are built where the batch lives (the host, normally) and copied without stalling the GPU.
        inputs = build_inputs(ids, batch[keys.ATTENTION_MASK], batch[keys.POSITION_IDS], r, self.spec.packed,
                              vision)
        if idle_tower and inputs.vision is None:
            inputs = dataclasses.replace(inputs, idle_tower=True)
        inputs = inputs.to(self.device)
        with contextlib.ExitStack() as forward_only:
            agreement = (forward_only if replay_scope is None else replay_scope).enter_context(routing_replay(
                self.module, batch.get(ROUTED), batch[keys.ATTENTION_MASK], self.spec.packed, self.spec.routing_replay,
                self.device))
            with router_logits(self.module, moe_aux) as logits:  # the forward only: the recomputation adds none
                out = self.module(hf_inputs=inputs, hf_request=req)
            agree = agreement()
        if agree is not None and req.kind == "lm":
            out[AGREEMENT] = agree.float().index_select(0, inputs.src_K)
        res = ({"scores": out[keys.VALUES]} if req.kind == "score"
               else {k: scatter_to_responses(v, inputs.dst_K, b, r) for k, v in out.items()})
        if moe_aux:  # packed: every token the model saw is real; padded: the attention mask says which
            res[AUX_LOSS] = load_balancing_loss(logits, self.module.config.num_experts_per_tok, inputs.attention_mask)
        return res, inputs.num_tokens

    def _micro_batches(self, data: DataProto, batching: MicroBatching) -> list[list[int]]:
        if batching.dynamic:
            return token_budget_micro_batches(data.batch[keys.ATTENTION_MASK].sum(-1).tolist(), batching.max_tokens)
        return fixed_micro_batches(len(data), batching.size)

    def _check_head(self, head: HeadRequest) -> None:
        wants = "lm" if head.kind == "lm" else "value"
        if wants != self.spec.head:
            what = "log-probs need a language-model head" if wants == "lm" else "values and scores need a scalar head"
            raise ValueError(f"{what}; this engine's module has the {self.spec.head!r} head (EngineSpec.head)")

    @torch.no_grad()
    def infer(self, data: DataProto, head: HeadRequest, *, disable_adapters: bool = False,
              beside: Callable[[], object] | None = None) -> dict[str, torch.Tensor]:
        """Forward passes over `data` in `spec.infer_batching` micro-batches; CPU float32 outputs in row order:
        lm → `log_probs` [B, R] (+ `entropy` [B, R]) of `responses` under softmax(logits / temperature);
        value → `values` [B, R], the scalar head at the position before each response token (critic);
        score → `scores` [B], the scalar head at each sequence's last valid token (reward model).
        `disable_adapters` (LoRA): the base model's outputs — the reference policy without a second model.
        `beside`: host work (the driver's reward scoring, `protocol.late`) called once every forward is queued,
        before the outputs are copied to the host, so it runs while the device computes; its result is ignored."""
        self._check_head(head)
        if disable_adapters and self.lora_targets is None:
            raise ValueError("disable_adapters=True needs LoRA adapters (model.lora.rank > 0); this engine has none")
        with adapters_disabled(self.module) if disable_adapters else contextlib.nullcontext():
            return self._infer(data, head, beside)

    def _infer(self, data: DataProto, head: HeadRequest,
               beside: Callable[[], object] | None = None) -> dict[str, torch.Tensor]:
        missing = [k for k in INPUT_KEYS if k not in data.batch]
        if missing:
            raise ValueError(f"batch lacks {missing}; the engine needs {list(INPUT_KEYS)} (verl layout)")
        self._enter(optim=False)
        self.module.eval()
        parts: dict[str, list[torch.Tensor]] = defaultdict(list)
        order: list[int] = []
        images = vision_column(data.non_tensor_batch)
        try:
            for i, idx in enumerate(self._micro_batches(data, self.spec.infer_batching)):
                beat(i)
                index = torch.tensor(idx)
                out, _ = self._forward_micro({k: data.batch[k][index] for k in (*INPUT_KEYS, ROUTED)
                                              if k in data.batch}, head,
                                             None if images is None else [images[j] for j in idx])
                for k, v in out.items():
                    parts[k].append(v.float())
                order += idx
            if beside is not None:  # the forwards are queued: the host works while the device runs them
                beside()
            # one copy to the host at the end (a .cpu() per micro-batch would stall the GPU each time)
            if sorted(order) != list(range(len(data))):
                raise RuntimeError(f"micro-batches covered {len(order)} rows, not each of the {len(data)} once")
            inverse = torch.empty(len(order), dtype=torch.long)
            inverse[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
            results = {k: torch.cat(v)[inverse.to(v[0].device)].cpu() for k, v in parts.items()}
        finally:
            self.to_rest()
        return results

    # ----------------------------------------------------------------------------------------- training
    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Train placement (weights + optimizer on the device) and train mode for `forward_backward`/`step` calls;
        afterwards back to rest. An exception inside drops any half-accumulated gradient, so the next update equals
        a fresh engine's."""
        if self.optimizer is None:
            raise ValueError("this engine is not trainable (EngineSpec.optimizer is None: no optimizer)")
        self._prefetch_optimizer()
        self.module.train()
        self._training = True
        try:
            yield
        except BaseException as err:
            try:  # a failed mini-batch leaves no half-accumulated gradient behind
                self._drop_partial_grads()
            except Exception as cleanup:  # keep the original error the one raised; say the engine is unusable
                logger.error("after %s, resetting the engine's gradients/FSDP state failed (%s: %s): build a new "
                             "engine or reload a checkpoint before training on", type(err).__name__,
                             type(cleanup).__name__, cleanup)
            raise
        finally:
            self._training = False
            self._pending_loss = None
            self._set_grad_sync(True)  # an exception mid-mini-batch must not leave gradient sync off
            self.to_rest()

    def _mini_batch_sums(self, batch: DataProto) -> tuple[dict[str, torch.Tensor], torch.Tensor, bool]:
        """Over all ranks, in one all-reduce per mini-batch: each loss_agg_mode's normaliser, the real tokens (the
        MoE load-balancing loss's weights) and — several ranks and a trainable vision tower only, a host read —
        whether any rank holds an image. Then every micro-batch without one gives the tower a zero gradient, so the
        ranks' reduce-scatters of the root FSDP2 group (the tower's) match; with no image anywhere none does."""
        images = vision_column(batch.non_tensor_batch) if self._trains_tower else None
        mask = batch.batch[keys.RESPONSE_MASK]
        has_image = torch.full((), float(images is not None and any(images)), device=mask.device)
        parts = [*(loss_normalizer(mask, m) for m in LOSS_AGG_MODES), batch.batch[keys.ATTENTION_MASK].sum(), has_image]
        local = torch.stack([t.to(torch.float64) for t in parts])
        if self.dp_size > 1:
            local = local.to(self.device)
            dist.all_reduce(local)
        norms = {m: local[i].float().to(self.device) for i, m in enumerate(LOSS_AGG_MODES)}
        n = len(LOSS_AGG_MODES)
        idle_tower = self.dp_size > 1 and self._trains_tower and bool(local[n + 1].item() > 0)
        return norms, local[n].float().to(self.device), idle_tower

    def forward_backward(self, batch: DataProto, loss_fn: LossFn, head: HeadRequest,
                         late: Callable[[], DataProto] | None = None) -> BackwardStats:
        """Accumulate the gradients of `loss_fn` over this rank's mini-batch `batch`, cut by `spec.train_batching`.

        `loss_fn(outputs, micro_batch, global_norm)` gets `global_norm[mode]` = the whole mini-batch's normaliser
        over all ranks for each loss_agg_mode. Call inside `with engine.training():`; `step()` applies the sum.
        `late`: returns `batch`'s rows with columns the loss needs that were not ready at the call (`protocol.late`);
        it is called once the first micro-batch's forward is queued, so the device computes while it waits.
        `spec.moe_aux_loss_coef` > 0 (MoE): each micro-batch's loss also gets coef × its routers' load-balancing
        loss × its share of the mini-batch's real tokens (all ranks), and the metric `moe/aux_loss` (its own value).
        """
        if late is not None:
            late = _once(late)
        if not self._training:
            raise RuntimeError("forward_backward runs inside `with engine.training():` (placement, train mode, "
                               "cleanup on failure)")
        self._check_head(head)
        global_norm, real_tokens, idle_tower = self._mini_batch_sums(batch)
        fresh = self._pending_loss is None
        if fresh:  # a new accumulation (the last step's gradients stay readable until now)
            self._zero_grad()
        batching = self._train_batching_now()
        try:
            return self._accumulate(batch, loss_fn, head, global_norm, batching, late, idle_tower, real_tokens)
        except torch.cuda.OutOfMemoryError:
            if not (fresh and self._may_retry_oom(batching)):
                raise
        # One retry at half the micro-batch: drop this mini-batch's partial gradients and run it again.
        self._zero_grad()
        self._pending_loss = None
        torch.cuda.empty_cache()
        self._train_micro_override = max(1, batching.size // 2)
        logger.warning("out of memory at %d samples per training micro-batch; retrying this and later mini-batches at "
                       "%d (set actor/critic ppo_micro_batch_size_per_gpu to choose)", batching.size,
                       self._train_micro_override)
        return self._accumulate(batch, loss_fn, head, global_norm, self._train_batching_now(), late, idle_tower,
                                real_tokens)

    def _train_batching_now(self) -> MicroBatching:
        size = self._train_micro_override
        b = self.spec.train_batching
        return b if size is None else MicroBatching(size, b.dynamic, b.max_tokens)

    def _may_retry_oom(self, batching: MicroBatching) -> bool:
        """Halving is safe on one rank only (other ranks would wait in a collective) and once per engine."""
        return (self.device.type == "cuda" and self.dp_size == 1 and not batching.dynamic and batching.size > 1
                and self._train_micro_override is None)

    def _accumulate(self, batch: DataProto, loss_fn: LossFn, head: HeadRequest, global_norm: dict[str, torch.Tensor],
                    batching: MicroBatching, late: Callable[[], DataProto] | None = None,
                    idle_tower: bool = False, real_tokens: torch.Tensor | None = None) -> BackwardStats:
        loss_total = torch.zeros((), device=self.device)
        sums: dict[str, torch.Tensor | float] = {}
        micro = self._micro_batches(batch, batching)
        tokens, flops = 0, 0.0
        aux_coef = self.spec.moe_aux_loss_coef
        for i, idx in enumerate(micro):
            beat(i)
            self._set_grad_sync(i == len(micro) - 1)
            mb = batch.select_idxs(idx)
            head_tokens = int(mb.batch[keys.ATTENTION_MASK][:, -mb.batch[keys.RESPONSES].shape[1]:].sum())
            flops += self.flops.train_flops(mb.batch[keys.ATTENTION_MASK].sum(-1).tolist(), head_tokens)
            # MoE routing replay stays on through the backward, where checkpointed layers run their forward again
            with contextlib.ExitStack() as replay_scope:
                outputs, n_tok = self._forward_micro(mb.batch, head, vision_column(mb.non_tensor_batch), idle_tower,
                                                     aux_coef > 0, replay_scope)
                aux = outputs.pop(AUX_LOSS, None)
                if late is not None:  # the forward is queued: wait for the late columns while the device runs it
                    batch = batch.select().union(new_columns(batch, late()))
                    mb, late = batch.select_idxs(idx), None
                mb_dev = mb.to(self.device, non_blocking=True)
                loss, metrics = loss_fn(outputs, mb_dev, global_norm)
                if aux is not None:
                    # weighted by the micro-batch's share of the mini-batch's real tokens (all ranks), as the
                    # token-normalised losses are: summed over micro-batches and ranks, a token-weighted mean
                    loss = loss + aux_coef * aux * (n_tok / real_tokens)
                    metrics = {**metrics, AUX_METRIC: aux.detach()}
                # loss is this micro-batch's share of the whole mini-batch loss; FSDP averages gradients over
                # ranks, so scale by the DP size to get the sum.
                (loss * self.dp_size).backward()
            loss_total += loss.detach()
            for k, v in metrics.items():  # device tensors stay on device: one host sync per mini-batch, not per metric
                sums[k] = sums.get(k, 0.0) + (v.detach().float() if isinstance(v, torch.Tensor) else float(v))
            tokens += n_tok
        self._pending_loss = loss_total if self._pending_loss is None else self._pending_loss + loss_total
        return BackwardStats(metrics={k: v / len(micro) for k, v in sums.items()}, num_tokens=tokens, flops=flops)

    def step(self) -> dict[str, torch.Tensor]:
        """Clip and apply the accumulated gradients; skipped when the gradient norm or the loss (summed over ranks)
        is not finite. Returns device scalars `loss` (summed over ranks), `grad_norm`, `skipped` (0/1), left on the
        device: `train_update` reads an update's metrics once at its end (`host_floats`).

        With the fused optimizer (CUDA) the skip is decided on the device — AdamW's `found_inf` leaves weights,
        moments and step counts as they were — so nothing here waits for the GPU; otherwise (CPU) the flag is read
        here and the gradients are dropped."""
        if not self._training or self._pending_loss is None:
            raise RuntimeError("step() applies what forward_backward accumulated inside `with engine.training():`")
        loss_total, self._pending_loss = self._pending_loss, None
        if self.dp_size > 1:  # every rank decides on the same numbers (the norm is already global)
            dist.all_reduce(loss_total)
        params = [p for p in self.module.parameters() if p.grad is not None]
        grad_norm = self._grad_norm(params)
        bad = ~(torch.isfinite(grad_norm) & torch.isfinite(loss_total))
        # A non-finite norm makes the clipped gradients NaN/0; they are never applied (skip below).
        if self.host_optimizer is not None:  # clipped on the host; the skip needs the flag there anyway
            self.host_optimizer.step(grad_norm, self.spec.optimizer.grad_clip, skip=bool(bad))
            return {"loss": loss_total, "grad_norm": grad_norm, "skipped": bad.float()}
        torch.nn.utils.clip_grads_with_norm_(params, self.spec.optimizer.grad_clip, grad_norm, foreach=True)
        if is_fused(self.optimizer):
            self.optimizer.found_inf = bad.float()
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
        elif bool(bad):
            self._zero_grad()
        else:
            self.optimizer.step()
        return {"loss": loss_total, "grad_norm": grad_norm, "skipped": bad.float()}

    def lr_scheduler_step(self) -> float:
        """End of one update (one training step of the caller): advance the LR schedule; returns the new LR."""
        with warnings.catch_warnings():
            # A skipped (non-finite) step still advances the schedule; torch warns about that order.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step", category=UserWarning)
            self.lr_scheduler.step()
        self.global_step += 1
        return self.lr_scheduler.get_last_lr()[0]

    def _set_grad_sync(self, sync: bool) -> None:
        """`fsdp.defer_grad_sync`: micro-batches before a mini-batch's last neither reduce nor reshard: FSDP2
        accumulates their gradients unsharded in `reduce_dtype` and keeps the compute-dtype weights gathered after
        backward, so a mini-batch reduces (reduce-scatters) the gradient once instead of once per micro-batch, and
        casts/gathers the weights once when `reshard_after_forward` is false (with true, each forward still frees
        them and backward gathers them again). On one rank (auto) the unsharded gradient is the shard's size and
        the sums are the same in the same order. On N ranks (true) each rank holds a full-size `reduce_dtype`
        gradient and the full compute-dtype weights between micro-batches (4 + 2 bytes per parameter; 9.3 GB for
        1.5B), and the sum over ranks happens once instead of per micro-batch (equal up to rounding order).
        Assumes every trainable parameter gets a gradient in every micro-batch (dense models: all we build); a
        parameter first reached only in the last micro-batch would mix dtypes in FSDP2's reduce-scatter."""
        if self._defer_grad_sync:
            self.module.set_requires_gradient_sync(sync)
            self.module.set_reshard_after_backward(sync)

    def _drop_partial_grads(self) -> None:
        """After a mini-batch failed part-way (in the loss, forward or backward): drop what it accumulated and
        reset FSDP2's per-iteration state, so the next step equals a fresh engine's (tests). Gradients live in
        `unsharded_accumulated_grad` (deferred sync with a reduce dtype), on the unsharded parameter (deferred sync
        without one) or on the sharded parameter; FSDP2's state would otherwise keep e.g. the root's post-backward
        callback marked as queued, and the next backward would skip it."""
        for m in self.module.modules():
            for group in _param_groups(m):
                for fsdp_param in getattr(group, "fsdp_params", ()):
                    fsdp_param.unsharded_accumulated_grad = None
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None
        if self.optimizer is not None:
            self._zero_grad()
        if hasattr(self.module, "reset_iter_state"):  # torch >= 2.12
            self.module.reset_iter_state()
            return
        _reset_fsdp_iter_state(self.module._get_fsdp_state())

    def _zero_grad(self) -> None:
        if self.host_optimizer is not None:
            self.host_optimizer.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    @staticmethod
    def _grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
        grads = [p.grad for p in params]
        if all(g.dtype == torch.float32 for g in grads):
            norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        else:  # compute-dtype gradients (optimizer_offload=cpu_step): sum the squares in fp32
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)
                                                         for g in grads]), 2.0)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # ----------------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """{"model", "optimizer" (sharded, DCP-ready), "extra" (JSON-safe counters)}."""
        self._enter(optim=True)
        trainable_only = self.lora_targets is not None
        if self.host_optimizer is not None:
            state = ckpt.get_host_step_state(self.module, self.host_optimizer, trainable_only)
        else:
            state = ckpt.get_engine_state(self.module, self.optimizer, trainable_only)
        state["extra"] = {"global_step": self.global_step,
                          "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._enter(optim=True)
        if self.host_optimizer is not None:
            ckpt.set_host_step_state(self.module, self.host_optimizer, state)
        else:
            ckpt.set_engine_state(self.module, self.optimizer, state, trainable_only=self.lora_targets is not None)
        if self.optimizer is not None and self.host_optimizer is None:  # saved fused/foreach flags: ours win
            set_optimizer_kind(self.optimizer, fused=_wants_fused_optimizer(self.device))
        extra = state.get("extra") or {}
        self.global_step = int(extra.get("global_step", 0))
        if self.lr_scheduler is not None and extra.get("lr_scheduler"):
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        self.to_rest()


def _param_groups(module: torch.nn.Module) -> list[Any]:
    """FSDP2's parameter groups of one module (private API: a list from torch 2.12, one group before)."""
    return _state_groups(module._get_fsdp_state()) if isinstance(module, FSDPModule) else []


def _state_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [getattr(state, "_fsdp_param_group", None)]
    return [g for g in groups if g is not None]


def _reset_fsdp_iter_state(root_state: Any) -> None:
    """What `FSDPModule.reset_iter_state` (torch >= 2.12) does, for older torch: after a failed forward/backward,
    forget the in-flight collectives and per-iteration trackers, reshard every group (private fields)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    ctx, comm = root_state._state_ctx, root_state._comm_ctx
    comm.all_gather_state = None
    for name in ("reduce_scatter_states", "_last_post_reduce_events", "post_forward_order"):
        getattr(comm, name, []).clear()  # names as of torch 2.11-2.13
    for state in ctx.all_states:
        getattr(state, "_modules_to_run_forward", set()).clear()
        state._training_state = TrainingState.IDLE
        for group in _state_groups(state):
            group._all_gather_result = None
            group._post_reduce_event = None
            group._all_reduce_state = None
            group._partial_reduce_output = None
            group._post_forward_indices.clear()
            group._training_state = TrainingState.IDLE
            group._to_sharded()
    ctx.iter_forward_root = None
    ctx.post_backward_final_callback_queued = False


def _once(fn: Callable[[], DataProto]) -> Callable[[], DataProto]:
    """`fn`'s outcome — its result or its error — from the first call (an out-of-memory retry of the mini-batch
    calls it again: the late columns are computed once, and a failure is not retried)."""
    box: list[DataProto] = []
    failed: list[BaseException] = []

    def call() -> DataProto:
        if failed:
            raise failed[0]
        if not box:
            try:
                box.append(fn())
            except BaseException as exc:
                failed.append(exc)
                raise
        return box[0]

    return call


def _wants_fused_optimizer(device: torch.device) -> bool:
    return device.type == "cuda"


def host_floats(values: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Device scalars → floats with one copy to the host per device."""
    out = {k: float(v) for k, v in values.items() if not isinstance(v, torch.Tensor)}
    by_device: dict[torch.device, list[str]] = defaultdict(list)
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            by_device[v.device].append(k)
    for names in by_device.values():
        out |= dict(zip(names, torch.stack([values[k].reshape(()) for k in names]).tolist()))
    return out
