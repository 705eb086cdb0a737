"""`RolloutWorker`: the separate generation worker of the non-sync modes (`trainer.mode=one_step_off|async`).

It holds its own copy of the policy (a plain HF module in the actor's master dtype, no FSDP, no optimizer) and its
own `RolloutEngine` (KV cache, CUDA graphs), in its own resource pool (`resource_pool.rollout_process_on_nodes`).
The trainer sends new weights after each actor update (`receive_weights`, `workers/weight_sync.py`: the buckets as
call arguments, or with `trainer.weight_sync.transport=collective` a control message while the tensors come over the
weight group, `workers/weight_collective.py`); every generated row carries the `policy_version` (optimizer steps)
of the weights that produced it.

Calls are non-blocking (the driver overlaps them with training) and run in submission order on each rank (Ray runs
one call at a time per actor, first in first out): with `receive_weights`, weights sent after a generate request are
used from the next request on, never in the middle of one (`trainer.async.partial_rollout=abort`).

Partial rollouts (`trainer.async.partial_rollout=continue`): the driver sends weights with `receive_weights_live`,
which runs in the actor's own `weights` thread group, beside a generate call in progress. It leaves the weights in
a one-slot inbox; the generate call installs them at its next decode-chunk boundary (every
`trainer.async.weight_check_steps` decode steps) and its sequences continue under them; every token records the
version that sampled it (`rollout_policy_version` [b, R]), and the row's `policy_version` is its oldest token's.
With no generate call running the inbox is applied at once. `receive_weights_live` returns once its weights are
installed, so a later call never overwrites weights nobody used.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from hybridflow.config import Config
from hybridflow.controller import Dispatch, RoleGroup, Worker, future, per_rank, register
from hybridflow.engine.fsdp import DTYPES, resolve_dtype
from hybridflow.models.loader import load_module, load_tokenizer
from hybridflow.protocol import DataProto, keys
from hybridflow.rollout import build_rollout
from hybridflow.workers.hybrid_generate import seeds_to_meta
from hybridflow.workers.weight_collective import CollectiveWeights, WeightReceiver
from hybridflow.workers.weight_sync import WeightBucket, full_parameters, load_buckets

if TYPE_CHECKING:
    from torch import nn

    from hybridflow.rollout import RolloutEngine

logger = logging.getLogger(__name__)


Weights = list[WeightBucket] | CollectiveWeights  # what a weight sync carries, by trainer.weight_sync.transport
WEIGHTS_GROUP = "weights"  # the Ray thread group of `receive_weights_live` (partial_rollout=continue)


def continues_partial_rollouts(cfg: Config) -> bool:
    return cfg.trainer.mode == "async" and cfg.trainer.async_.partial_rollout == "continue"


class RolloutWorker(Worker):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.version = 0  # optimizer steps of the weights held
        self.module: nn.Module
        self.rollout: RolloutEngine
        self._idle_since: float | None = None  # end of the previous call (the time since is `timing/wait_train`)
        self._cv = threading.Condition()  # guards the inbox, `_generating` and the installing of weights
        self._inbox: tuple[list[WeightBucket], int] | None = None
        self._generating = False
        self._checks = 0  # weight checks of the current (or last) generate call
        self._last_load_s = 0.0
        self._install_error: BaseException | None = None  # a failed install, for the waiting sender
        self._receiver: WeightReceiver | None = None  # weight_sync.transport=collective

    @classmethod
    def concurrency_groups(cls, cfg: Config, *args: object, **kwargs: object) -> dict[str, int]:
        return {WEIGHTS_GROUP: 1} if continues_partial_rollouts(cfg) else {}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        cfg = self.cfg
        self.tokenizer = load_tokenizer(cfg.model)
        # the actor's master dtype: the rollout engine casts (bf16 on GPU) exactly as the hybrid engine does; with
        # LoRA the dtype of the actor's frozen base (the compute dtype), which the merged weights it sends keep
        dtype = resolve_dtype(cfg.model.dtype, self.device) if cfg.model.lora.enabled else \
            DTYPES[cfg.actor.fsdp.param_dtype]
        module = load_module(cfg.model, "lm", dtype=dtype, init_device=self.device)
        self.module = module.to(self.device).eval().requires_grad_(False)
        check_every = cfg.trainer.async_.weight_check_steps if continues_partial_rollouts(cfg) else None
        self.rollout = build_rollout(
            self.module, cfg.rollout, eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id, max_prompt_length=cfg.data.max_prompt_length,
            max_response_length=cfg.data.max_response_length, device=self.device, tokenizer=self.tokenizer,
            check_every=check_every, exact_logprobs=cfg.actor_rollout.exact_logprobs,
        )
        if check_every is not None and self.rollout.uses_hf_fallback:
            logger.warning("trainer.async.partial_rollout=continue: this model runs on the HF generate fallback, "
                           "which takes new weights only when a call starts, so in-flight sequences finish under "
                           "their old weights (as partial_rollout=abort would keep them)")
        self._idle_since = time.perf_counter()

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO, blocking=False)
    @keys.checked_stage(keys.GEN)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate with the weights of `self.version` (and, under partial_rollout=continue, any that arrive
        meanwhile); each token records the version that sampled it, each row its oldest token's."""
        t0 = time.perf_counter()
        with self._cv:
            self._generating, self._checks = True, 0
        try:
            out = self.rollout.generate(seeds_to_meta(prompts), weight_check=self._take_inbox).to("cpu")
        finally:
            with self._cv:
                self._generating = False
                self._take_inbox_locked()
        t1 = time.perf_counter()
        out.meta_info.pop(keys.SEEDS, None)
        per_token = out.batch[keys.ROLLOUT_POLICY_VERSION]
        out.batch[keys.POLICY_VERSION] = per_token.min(dim=1).values  # versions never decrease along a row
        engine_metrics = out.meta_info.get("metrics") or {}
        out.meta_info["metrics"] = {**engine_metrics, "timing/generate": t1 - t0,
                                    "timing/wait_train": self._idle(t0)}
        self._idle_since = t1
        return out

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def join_weight_group(self, address: tuple[str, int], size: int, timeout_s: float) -> str:
        """weight_sync.transport=collective: join the trainer's weight group as rank 1 + this rank (blocks until
        every member has joined); returns its backend (nccl or gloo)."""
        if self._receiver is not None:
            raise RuntimeError(f"rollout worker {self.rank}: already in a weight group (it is built once)")
        self._receiver = WeightReceiver(tuple(address), 1 + self.rank, size, self.device, timeout_s)
        return self._receiver.backend

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def receive_weights(self, weights: Weights, version: int) -> dict[str, float]:
        """Copy the trainer's weights (bit-exact) and make the next generate use them; `weights` are the buckets
        (transport `call`) or the control message of a broadcast to take now (`collective`)."""
        t0 = time.perf_counter()
        buckets, recv = self._arrived(weights)
        t1 = time.perf_counter()
        nbytes = load_buckets(self.module, buckets)
        self.rollout.sync_weights()
        self.version = int(version)
        t2 = time.perf_counter()
        idle = self._idle(t0)
        self._idle_since = t2
        return {"weight_sync/rollout_load_s": t2 - t1, "weight_sync/bytes": float(nbytes),
                "weight_sync/buckets": float(len(buckets)), "weight_sync/version": float(version),
                "timing/wait_train_sync": idle, **recv}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False, concurrency_group=WEIGHTS_GROUP)
    def receive_weights_live(self, weights: Weights, version: int) -> dict[str, float]:
        """partial_rollout=continue: hand the weights to the generate call in progress (installed at its next
        decode-chunk boundary) or install them now if none runs; returns once they are installed. A broadcast
        is received first, here in the `weights` thread, while the generate call runs on."""
        buckets, recv = self._arrived(weights)
        t0 = time.perf_counter()
        with self._cv:
            idle = self._idle(t0) if not self._generating else 0.0
            self._inbox, self._install_error = (buckets, int(version)), None
            if not self._generating:
                self._take_inbox_locked()
                self._idle_since = time.perf_counter()  # counted once here, not again by the next generate
            self._cv.wait_for(lambda: self._inbox is None or self._inbox[1] != int(version))
            if self._install_error is not None:
                raise RuntimeError(f"rollout worker: installing the weights of policy version {version} failed "
                                   f"inside a generate call: {self._install_error!r}") from self._install_error
            load_s = self._last_load_s
        nbytes = sum(b.nbytes for b in buckets)
        return {"weight_sync/rollout_load_s": load_s, "weight_sync/bytes": float(nbytes),
                "weight_sync/buckets": float(len(buckets)), "weight_sync/version": float(version),
                "weight_sync/rollout_wait_s": time.perf_counter() - t0 - load_s, "timing/wait_train_sync": idle,
                **recv}

    def _arrived(self, weights: Weights) -> tuple[list[WeightBucket], dict[str, float]]:
        """The buckets themselves (transport `call`), or those of the broadcast `weights` announces, received now
        into the weight group's buffers (`collective`; + the transfer's seconds)."""
        if not isinstance(weights, CollectiveWeights):
            return weights, {}
        if self._receiver is None:
            raise RuntimeError(f"rollout worker {self.rank}: got broadcast {weights.seq} of the weight group but "
                               "never joined it (join_weight_group)")
        buckets, seconds = self._receiver.receive(weights)
        return buckets, {"weight_sync/rollout_recv_s": seconds}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, concurrency_group=WEIGHTS_GROUP)
    def progress(self) -> dict[str, int]:
        """partial_rollout=continue (answers while a generate call runs): whether one runs, the weight checks it
        made so far (1 at its start, then one per decode chunk) and the version held."""
        with self._cv:
            return {"generating": int(self._generating), "weight_checks": self._checks, "version": self.version}

    def _take_inbox(self) -> int:
        """The generate call's weight check (between decode chunks): install waiting weights; the version now."""
        with self._cv:
            self._checks += 1
            return self._take_inbox_locked()

    def _take_inbox_locked(self) -> int:
        """Install the waiting weights, if any. The inbox is emptied first and the sender always woken: a failed
        install (a bucket that does not match the model, out of memory) raises here, in whichever call installs,
        and is handed to the waiting `receive_weights_live`, which re-raises it — nobody waits forever on it and
        the next generate does not trip over the same bad weights again."""
        if self._inbox is not None:
            (buckets, version), self._inbox = self._inbox, None
            t0 = time.perf_counter()
            try:
                load_buckets(self.module, buckets)
                self.rollout.sync_weights()
                self.version = version
                self._last_load_s = time.perf_counter() - t0
            except BaseException as err:
                self._install_error = err
                raise
            finally:
                self._cv.notify_all()
        return self.version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def weights(self) -> dict[str, torch.Tensor]:
        """The rollout's parameters (CPU copies) and nothing else: for checks (bit-exactness tests)."""
        return dict(full_parameters(self.module))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def policy_version(self) -> int:
        return self.version

    def _idle(self, now: float) -> float:
        return 0.0 if self._idle_since is None else max(0.0, now - self._idle_since)


class RolloutGroup(RoleGroup):
    """Driver-side handle of the `RolloutWorker` group."""

    worker_cls = RolloutWorker
    init_model = per_rank(RolloutWorker.init_model)
    generate_sequences = future(RolloutWorker.generate_sequences)
    receive_weights = future(RolloutWorker.receive_weights)
    receive_weights_live = future(RolloutWorker.receive_weights_live)
    join_weight_group = per_rank(RolloutWorker.join_weight_group)
    progress = per_rank(RolloutWorker.progress)
    weights = per_rank(RolloutWorker.weights)
    policy_version = per_rank(RolloutWorker.policy_version)
