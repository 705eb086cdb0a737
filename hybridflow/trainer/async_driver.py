"""The non-sync modes' driver side: generation on separate rollout workers, pipelined with training.

`trainer.mode=one_step_off` (`OneStepOffDriver`): the batch of step k+1 is submitted to the rollout workers before
step k trains, with the weights of version k-1; after step k's actor update the trainer's weights (version k) are
sent, queued behind that request, so the batch of step k+2 uses them. Staleness is 1 from step 2 on (0 at step 1).

`trainer.mode=async` (`AsyncDriver`): prompts go out in requests of `trainer.async.chunk_prompts`; at most
(max_staleness + 1) × train_batch_size prompts are outstanding (submitted and not yet trained), which bounds how old
a request can be when it is consumed; training takes finished requests in completion order until it has a batch.
With `trainer.async.partial_rollout=abort` weights change only between requests on the rollout worker, so a request
never spans two versions. With `continue` the weights go through `receive_weights_live`, which reaches a generate
call in progress: its sequences take them at the next decode-chunk boundary and each token records its version
(`rollout_policy_version`); a row's `policy_version` is its oldest token's. In both, a request whose oldest token is
older than `max_staleness` when consumed (possible after a rollback re-sync, or a weight send racing a generate
call on Ray's threads) is dropped whole and its prompts resubmitted with the newest weights: the unit of dropping
is the request, so a batch stays whole prompt groups.

DAPO dynamic sampling (`algorithm.filter_groups`): the driver runs the reward stage on each finished request, keeps
its informative groups (`trainer/dynamic_sampling.py`) and asks for more prompts while the batch is short — one_step_off
in sync mode's rounds (extra batches from the algorithm's extra loader, waited for), async as requests stream in (the
loader's batches until the steps are trained, then the extra loader); the step skips its reward stage (`scores`).

Both drivers are generators the loop iterates instead of the prompt batches (`Algorithm.batches`); each yielded
batch is already generated, and `PPOAlgorithm.step` takes it (`take`) instead of generating. Policy version = the
number of optimizer steps behind the weights; a sample trained at step t has staleness (t - 1) - its version.

A checkpoint holds the pipeline (`checkpoint_payload`, trainer/async_resume.py): the driver waits for its requests
in flight and saves them with the prompts not yet submitted, and a resumed driver continues with them.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.controller import GroupFuture, WorkerError, WorkerTimeoutError
from hybridflow.data.dataloader import DataPosition
from hybridflow.protocol import DataProto, keys
from hybridflow.trainer.async_resume import Pipeline, SavedRequest, from_payload, to_payload
from hybridflow.trainer.dynamic_sampling import InformativeGroups, combine_reward_metrics
from hybridflow.trainer.metrics import reduce_metrics
from hybridflow.trainer.weight_transport import build_weight_transport
from hybridflow.workers.rollout_worker import continues_partial_rollouts

if TYPE_CHECKING:
    from hybridflow.trainer.ppo import PPOAlgorithm
    from hybridflow.workers.rollout_worker import RolloutGroup


logger = logging.getLogger(__name__)

_SUMMED = ("rollout/weight_swaps",)  # request metrics added up over a batch (besides timing/*)
_CULPRIT_GRACE_S = 5.0  # a failed broadcast: how long to wait for the rollout side to report its failure


class RolloutWorkerFailed(WorkerError):
    """A rollout worker of a non-sync mode raised, died or timed out; names the group, method, rank and the step
    whose batch (or the policy version whose weights) it lost."""


def _receiving(version: int) -> str:
    return f"receiving the weights of policy version {version}"


@dataclass
class Request:
    """One generate call in flight: its prompts (to resubmit), the weights' version, the step it was planned for
    and the data position after its source batch."""

    future: GroupFuture | None  # None: restored from a checkpoint, finished (`result`)
    prompts: DataProto
    version: int
    planned_step: int
    source: int | None  # index of the source (loader) batch the prompts came from; None: dynamic sampling's extras
    syncs_before: int  # weight syncs sent before this request (queued ahead of it on the rollout worker)
    baseline: GroupFuture | None = None  # ReMax: the greedy responses of the same prompts
    result: tuple[DataProto, dict[str, float], float] | None = None  # once collected: (rows, metrics, s waited)


@dataclass
class _Source:
    position: DataPosition  # loader position after this batch
    chunks_left: int


@dataclass
class _StepInfo:
    metrics: dict[str, float] = field(default_factory=dict)


class RolloutDriver:
    """What both non-sync drivers share: submitting, collecting, weight sync, versions, metrics, data position."""

    def __init__(self, alg: PPOAlgorithm) -> None:
        if alg.groups.rollout is None:
            raise ValueError(f"trainer.mode={alg.cfg.trainer.mode} needs the rollout worker group; build the worker "
                             "groups with trainer/roles.build_worker_groups (it adds one for the non-sync modes)")
        self.alg, self.cfg = alg, alg.cfg
        self.rollout: RolloutGroup = alg.groups.rollout
        self.mode = self.cfg.trainer.mode
        self.version = 0  # the version the rollout workers hold once every queued sync has run
        self._syncs: list[tuple[GroupFuture, int, int]] = []  # weight syncs not collected: (future, version, number)
        self._n_syncs = 0  # weight syncs sent so far
        self._step_metrics: dict[int, dict[str, float]] = {}
        self._sources: dict[int, _Source] = {}
        self._next_source = 0
        self._trained_source = -1
        self.trained_position: DataPosition | None = None  # where a resumed run continues (None: the loader's)
        self.transport = build_weight_transport(self.cfg, alg.actor, self.rollout)  # collective: the group, once
        self._remax = self.cfg.algorithm.adv_estimator == "remax"
        self._send = self.rollout.receive_weights_live if continues_partial_rollouts(self.cfg) else \
            self.rollout.receive_weights
        # DAPO dynamic sampling: the driver scores each finished request, keeps the informative groups and asks
        # for more prompts while a batch is short; the step then skips its reward stage (`scores`)
        # (online DPO's step pairs best and worst responses itself and never filters)
        self.scores = self.cfg.algorithm.filter_groups.enable and not self.cfg.dpo.online
        self._max_gen_batches = self.cfg.algorithm.filter_groups.max_num_gen_batches
        self._restored: Pipeline | None = None  # from the checkpoint resumed, until `run` takes it

    # --------------------------------------------------------------------------------------- weight sync
    def sync_weights(self, version: int) -> dict[str, float]:
        """Send the actor's weights (policy `version`) to every rollout worker; they apply them after the requests
        already queued. Returns the trainer-side time (gather + pack; a broadcast runs on in the background), the
        bytes and the transport (`weight_sync/collective`: 1 for the broadcast, 0 for call arguments)."""
        t0 = time.perf_counter()
        try:
            staged = self.transport.stage()
        except WorkerError as err:  # collective: a broadcast failed; a dead or failed receiver is the cause
            raise self._broadcast_failed(version, err) from err
        try:
            self._syncs.append((self._send(staged.weights, version), version, self._n_syncs))
            self._n_syncs += 1
        except (WorkerError, WorkerTimeoutError) as err:  # the local backend runs it at once
            raise self._failed(_receiving(version), err) from err
        self.version = version
        return {"timing/weight_sync": time.perf_counter() - t0, "weight_sync/bytes": float(staged.nbytes),
                "weight_sync/buckets": float(staged.buckets), **staged.metrics}

    def _broadcast_failed(self, version: int, err: WorkerError) -> RolloutWorkerFailed:
        """A weight broadcast failed on the trainer's side (`err`, from actor rank 0): the error of the rollout
        worker whose `receive_weights` failed (it died, or raised) when one did within a few seconds; else the
        trainer's account, which cannot tell which receiver hung."""
        culprit = self._failed_sync(_CULPRIT_GRACE_S)
        if culprit is not None:
            return culprit
        wg = self.rollout.worker_group
        return RolloutWorkerFailed(
            wg.name, "receive_weights", -1,
            f"staging the weights of policy version {version} failed because an earlier broadcast to the rollout "
            f"workers ({wg.world_size} in group {wg.name!r}, trainer.mode={self.mode}) broke, with no rollout "
            f"worker reporting a failure (one hung?): {err.detail}. Training stops here; resume from the last "
            "checkpoint with trainer.resume_mode=auto", err.remote_traceback)

    def _failed_sync(self, grace_s: float = 0.0, before: int | None = None) -> RolloutWorkerFailed | None:
        """The first weight sync (of those sent before sync number `before`) that failed, waiting up to `grace_s`
        for each pending one, as the error to raise: a rollout rank runs its calls in order, so a failed sync
        explains the failures of the requests queued behind it."""
        for fut, version, number in self._syncs:
            if before is not None and number >= before:
                break
            if grace_s <= 0 and not fut.done():
                continue
            try:
                fut.get(timeout_s=grace_s if grace_s > 0 else None)
            except WorkerError as err:
                return self._failed(_receiving(version), err)
            except WorkerTimeoutError:
                continue  # still waiting for its broadcast: not the one that failed
        return None

    def after_update(self, step: int) -> dict[str, float]:
        """Called by the PPO step after the actor update of `step`: the rollout gets policy version `step`."""
        return self.sync_weights(step)

    def on_rollback(self, step: int) -> None:
        """The trainer's weights were rolled back: re-send them (labelled with the current version)."""
        self.sync_weights(step)

    def _collect_syncs(self) -> dict[str, float]:
        out: dict[str, float] = {}
        done = [sync for sync in self._syncs if sync[0].done()]
        self._syncs = [sync for sync in self._syncs if not sync[0].done()]
        for fut, version, _ in done:
            try:
                per_rank = fut.get()
            except (WorkerError, WorkerTimeoutError) as err:
                raise self._failed(_receiving(version), err) from err
            m = reduce_metrics(per_rank)
            out["timing/wait_train"] = out.get("timing/wait_train", 0.0) + m.pop("timing/wait_train_sync", 0.0)
            for k in ("weight_sync/rollout_load_s", "weight_sync/rollout_wait_s", "weight_sync/rollout_recv_s"):
                if k in m:
                    out[k] = out.get(k, 0.0) + m[k]
        return out

    # ----------------------------------------------------------------------------------------- requests
    def _submit(self, prompts: DataProto, planned_step: int, source: int | None) -> Request:
        alg = self.alg
        alg.global_step = planned_step  # the sampling seeds of (rollout.seed, step, call): the same as sync mode's
        seeded = alg.with_seeds(prompts)
        try:
            fut = self.rollout.generate_sequences(seeded)
            # ReMax: the greedy baseline response per prompt, queued right behind the samples (same weights under
            # abort; under continue it may see newer ones — still independent of the samples, so still a baseline)
            baseline = self.rollout.generate_sequences(alg.greedy_prompts(seeded)) if self._remax else None
        except (WorkerError, WorkerTimeoutError) as err:
            raise self._failed(f"generating for step {planned_step}", err) from err
        return Request(fut, prompts, self.version, planned_step, source, self._n_syncs, baseline)

    def _collect(self, req: Request) -> tuple[DataProto, dict[str, float], float]:
        """Wait for `req`; (generated rows, the rollout's metrics, seconds waited). Kept in `req.result`."""
        if req.result is not None:
            out, metrics, waited = req.result
            return out, dict(metrics), waited
        assert req.future is not None, "a request without a future was restored with its result"
        t0 = time.perf_counter()
        try:
            out = req.future.get()
            greedy = req.baseline.get() if req.baseline is not None else None
        except (WorkerError, WorkerTimeoutError) as err:
            raise (self._failed_sync(before=req.syncs_before) or
                   self._failed(f"generating for step {req.planned_step}", err)) from err
        waited = time.perf_counter() - t0
        if greedy is not None:  # as the sync step does
            out.batch[keys.BASELINE_REWARDS] = self.alg.baseline_rewards(greedy)
        req.result = (out, reduce_metrics(out.meta_info.pop("metrics", [])), waited)
        return out, dict(req.result[1]), waited

    def _failed(self, what: str, err: WorkerError | WorkerTimeoutError) -> RolloutWorkerFailed:
        wg = self.rollout.worker_group
        if isinstance(err, WorkerError):
            rank, detail, trace = err.rank, err.detail, err.remote_traceback
        else:
            rank, detail, trace = (err.pending_ranks or [-1])[0], str(err), ""
        return RolloutWorkerFailed(
            wg.name, err.method, rank,
            f"the rollout worker ({wg.world_size} in group {wg.name!r}, trainer.mode={self.mode}) failed while "
            f"{what}: {detail}. Training stops here; resume from the last checkpoint with "
            f"trainer.resume_mode=auto", trace)

    def _pull_source(self, it: Iterator[DataProto], chunks: int) -> tuple[int, DataProto] | None:
        try:
            batch = next(it)
        except StopIteration:
            return None
        index = self._next_source
        self._next_source += 1
        meta = batch.meta_info
        pos = DataPosition(int(meta.get("epoch", 0)), int(meta.get("batch_in_epoch", index)) + 1)
        self._sources[index] = _Source(pos, chunks)
        return index, batch

    def _mark_trained(self, source: int | None) -> None:
        if source is None:  # dynamic sampling's extra prompts: not from the loader position the run resumes at
            return
        src = self._sources[source]
        src.chunks_left -= 1
        while (nxt := self._sources.get(self._trained_source + 1)) is not None and nxt.chunks_left == 0:
            self._trained_source += 1
            self.trained_position = nxt.position
            del self._sources[self._trained_source]

    # -------------------------------------------------------------------------------- dynamic sampling
    def _groups(self) -> InformativeGroups:
        res = self.alg.res
        return InformativeGroups(res.samples_per_step, self.cfg.rollout.n, res.world_size)

    def _score(self, out: DataProto, scored: list[tuple[int, dict[str, float]]]) -> tuple[DataProto, float]:
        """The reward stage on a finished request (as the sync step runs it); its metrics go to `scored`."""
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        out = self.alg.reward(out, metrics)
        scored.append((len(out), metrics))
        return out, time.perf_counter() - t0

    @staticmethod
    def _add_gen_metrics(metrics: dict[str, float], gen: dict[str, float]) -> None:
        for k, v in gen.items():
            metrics[k] = metrics.get(k, 0.0) + v if k.startswith("timing/") or k in _SUMMED else v

    # ------------------------------------------------------------------------------------------ batches
    def _ready(self, batch: DataProto, step: int, metrics: dict[str, float]) -> DataProto:
        versions = batch.batch[keys.POLICY_VERSION].to(torch.float64)  # per row: its oldest token's
        staleness = (step - 1) - versions
        metrics |= {"staleness/mean": float(staleness.mean()), "staleness/max": float(staleness.max()),
                    "staleness/min_version": float(versions.min())}
        per_token = batch.batch.get(keys.ROLLOUT_POLICY_VERSION)
        if per_token is not None:
            mask = batch.batch[keys.RESPONSE_MASK].bool()
            token_staleness = ((step - 1) - per_token.to(torch.float64))[mask]
            big = torch.iinfo(per_token.dtype).max
            newest = per_token.masked_fill(~mask, -big).max(1).values  # over the row's own tokens, not its padding
            oldest = per_token.masked_fill(~mask, big).min(1).values
            metrics |= {"staleness/token_mean": float(token_staleness.mean()) if mask.any() else 0.0,
                        "async/mixed_version_rows": float(((newest != oldest) & mask.any(1)).to(torch.float64).mean())}
        syncs = self._collect_syncs()
        metrics["timing/wait_train"] = metrics.get("timing/wait_train", 0.0) + syncs.pop("timing/wait_train", 0.0)
        metrics |= syncs
        self._step_metrics[step] = metrics
        return batch

    def take(self, batch: DataProto, step: int, metrics: dict[str, float]) -> DataProto:
        """The PPO step's `gen` stage in a non-sync mode: the batch is already generated; add its metrics."""
        if keys.RESPONSES not in batch.batch:
            raise RuntimeError(f"trainer.mode={self.mode}: step {step} got a batch of prompts, not generated rows; "
                               "iterate PPOAlgorithm.batches(...) (the loop does) instead of the loader")
        metrics |= self._step_metrics.pop(step, {})
        return batch

    def state_dict(self) -> dict[str, Any]:
        """Overrides the loop's data position with the position after the last batch trained: a resume without
        the checkpoint's payload generates the prompts ahead of it again; with it, the driver skips them."""
        return {} if self.trained_position is None else {"data": self.trained_position.to_dict()}

    # ------------------------------------------------------------------------------------------- resume
    def _in_flight(self) -> list[Request]:
        """The requests submitted and not yet taken by a step, in the order the steps take them."""
        return []

    def _pipeline(self, requests: list[SavedRequest]) -> Pipeline:
        return Pipeline(self.mode, requests, sources={i: (s.position, s.chunks_left) for i, s in self._sources.items()},
                        next_source=self._next_source, trained_source=self._trained_source,
                        trained_position=self.trained_position)

    def checkpoint_payload(self) -> dict[str, Any] | None:
        """The pipeline for the checkpoint being saved: waits for the requests in flight (their weights may be gone
        after this step), then the finished rows with their versions and metrics, and the prompts not submitted.
        None when nothing is ahead of the trained data, or (warned) when a rollout worker failed or a column cannot
        be saved: a resume then generates those prompts again."""
        requests = self._in_flight()
        try:
            results = [(req, self._collect(req)) for req in requests]
        except RolloutWorkerFailed as err:
            logger.warning("checkpoint without the rollouts generated ahead (a resume generates them again): %s", err)
            return None
        pipe = self._pipeline([SavedRequest(out, metrics, req.prompts, req.version, req.planned_step, req.source)
                               for req, (out, metrics, _) in results])
        if not pipe.requests and not pipe.pending:
            return None
        try:
            return to_payload(pipe)
        except ValueError as err:
            logger.warning("checkpoint without the rollouts generated ahead (a resume generates them again): %s", err)
            return None

    def load_checkpoint_payload(self, payload: dict[str, Any]) -> None:
        self._restored = from_payload(payload, self.mode)

    def _restore(self, it: Iterator[DataProto]) -> tuple[Iterator[DataProto], Pipeline | None]:
        """Take the restored pipeline: the loader resumed after the last batch trained, so the batches whose
        prompts the pipeline holds come next — skip them (their uids must be the saved prompts'; otherwise the
        data changed, and they are generated again)."""
        pipe, self._restored = self._restored, None
        if pipe is None:
            return it, None
        want, skipped = pipe.source_uids(), []
        for index in range(pipe.trained_source + 1, pipe.next_source):
            batch = next(it, None)
            if batch is None:
                break
            skipped.append(batch)
            uids = set(map(str, batch.non_tensor_batch.get(keys.UID, [])))
            if not want.get(index, set()) <= uids:
                break
        else:
            self._sources = {i: _Source(pos, left) for i, (pos, left) in pipe.sources.items()}
            self._next_source, self._trained_source = pipe.next_source, pipe.trained_source
            self.trained_position = pipe.trained_position
            logger.info("resumed the %s pipeline: %d finished request(s), %d prompt chunk(s) not yet submitted",
                        self.mode, len(pipe.requests), len(pipe.pending))
            return it, pipe
        logger.warning("the checkpoint's rollouts generated ahead do not match the batches the loader gives after "
                       "the trained position (data settings changed?): generating those prompts again")
        return itertools.chain(skipped, it), None

    @staticmethod
    def _restored_request(saved: SavedRequest) -> Request:
        return Request(None, saved.prompts, saved.version, saved.planned_step, saved.source, 0,
                       result=(saved.rows, saved.metrics, 0.0))


class OneStepOffDriver(RolloutDriver):
    def __init__(self, alg: PPOAlgorithm) -> None:
        super().__init__(alg)
        self._ahead: Request | None = None  # the next step's batch, generating while this step trains

    def _in_flight(self) -> list[Request]:
        return [] if self._ahead is None else [self._ahead]

    def run(self, source: Iterator[DataProto], start_step: int) -> Iterator[DataProto]:
        self.sync_weights(start_step)  # fresh: the same weights; resumed: the checkpoint's
        it, restored = self._restore(iter(source))
        step, total = start_step, self.alg.total_steps
        if restored is not None and restored.requests:  # generated before the save, with the weights it names
            self._ahead = self._restored_request(restored.requests[0])
        elif (pulled := self._pull_source(it, 1)) is not None:
            self._ahead = self._submit(pulled[1], step + 1, pulled[0])
        while (req := self._ahead) is not None:
            step += 1
            out, metrics, waited = self._collect(req)
            self._mark_trained(req.source)
            if self.scores:
                out, waited_more = self._fill(out, step, metrics)
                waited += waited_more
            self._ahead = None
            if step < total and (pulled := self._pull_source(it, 1)) is not None:
                self._ahead = self._submit(pulled[1], step + 1, pulled[0])  # generates while this step trains
            metrics["timing/wait_rollout"] = waited
            yield self._ready(out, step, metrics)

    def _fill(self, out: DataProto, step: int, metrics: dict[str, float]) -> tuple[DataProto, float]:
        """Dynamic sampling as the sync step does it: score the batch, keep its informative groups and, while
        short, generate a batch of the algorithm's extra prompts (sync mode's stream) and wait for it. Returns
        the training batch and the seconds waited."""
        groups, scored = self._groups(), []
        out, reward_s = self._score(out, scored)
        groups.add(out)
        rounds, waited = 1, 0.0
        while not groups.full and rounds < self._max_gen_batches:
            more, gen_metrics, w = self._collect(self._submit(self.alg.extra_batch(), step, None))
            waited += w
            self._add_gen_metrics(metrics, gen_metrics)
            more, seconds = self._score(more, scored)
            reward_s += seconds
            groups.add(more)
            rounds += 1
        metrics |= combine_reward_metrics(scored) | {"timing/reward": reward_s}
        return groups.batch(metrics, rounds), waited


class AsyncDriver(RolloutDriver):
    def __init__(self, alg: PPOAlgorithm) -> None:
        super().__init__(alg)
        a = self.cfg.trainer.async_
        self.batch_prompts = self.cfg.data.train_batch_size
        self.chunk = a.chunk_prompts or max(1, self.batch_prompts // 4)
        self.max_staleness = a.max_staleness
        self.capacity = (self.max_staleness + 1) * self.batch_prompts  # prompts submitted and not yet trained
        self._queue: deque[Request] = deque()
        self._pending: deque[tuple[DataProto, int, int | None]] = deque()  # (prompts, planned step, source)
        self._outstanding = 0  # prompts submitted and not yet trained
        self._planned = 0  # the last step whose source batch was split into requests
        self._exhausted = False  # the loader ran out
        self._aborted = 0  # prompts dropped for staleness and resubmitted, over the run

    def _in_flight(self) -> list[Request]:
        return list(self._queue)

    def _pipeline(self, requests: list[SavedRequest]) -> Pipeline:
        pipe = super()._pipeline(requests)
        pipe.pending = list(self._pending)
        pipe.counters = {"outstanding": self._outstanding, "planned": self._planned,
                         "exhausted": int(self._exhausted), "aborted": self._aborted}
        return pipe

    def run(self, source: Iterator[DataProto], start_step: int) -> Iterator[DataProto]:
        self.sync_weights(start_step)
        it, restored = self._restore(iter(source))
        step, total, yielded = start_step, self.alg.total_steps, start_step
        queue, pending = self._queue, self._pending
        self._planned = start_step
        if restored is not None:  # finished requests first, in their order, then the chunks not yet submitted
            queue.extend(self._restored_request(r) for r in restored.requests)
            pending.extend(restored.pending)
            c = restored.counters
            self._outstanding, self._planned = c["outstanding"], c["planned"]
            self._exhausted, self._aborted = bool(c["exhausted"]), c["aborted"]

        def pull() -> bool:
            """Split the next source batch into pending requests. Without dynamic sampling one batch per step
            (as many as the steps left); with it, until the steps are trained: the loader's batches, then the
            extra stream (sync mode's, for what filtering dropped) once the loader has run out."""
            if not self.scores and self._planned >= total:
                return False
            if self.scores and yielded >= total:
                return False
            pulled = None if self._exhausted else self._pull_source(it, self.batch_prompts // self.chunk)
            if pulled is None:
                self._exhausted = True
                if not self.scores:
                    return False
                pulled = (None, self.alg.extra_batch())
            self._planned += 1
            index, batch = pulled
            for lo in range(0, len(batch), self.chunk):
                pending.append((batch[lo:lo + self.chunk], self._planned, index))
            return True

        def fill() -> None:
            while self._outstanding < self.capacity:
                if not pending and not pull():
                    return
                prompts, plan, index = pending.popleft()
                queue.append(self._submit(prompts, plan, index))
                self._outstanding += len(prompts)

        fill()
        while queue:
            step += 1
            parts: list[DataProto] = []
            metrics: dict[str, float] = {}
            groups, scored = (self._groups(), []) if self.scores else (None, [])
            have, consumed, requests, waited, wait_train, reward_s = 0, 0, 0, 0.0, 0.0, 0.0
            while (have < self.batch_prompts) if groups is None else not groups.full:
                if groups is not None and consumed >= self._max_gen_batches * self.batch_prompts:
                    break  # dynamic sampling's budget is spent: train on what there is
                if not queue:
                    fill()
                    if not queue:
                        return  # the data ran out mid-batch (drop_last=false): nothing more to train
                req = queue[0]  # stays in the queue (a save holds it) until taken
                out, gen_metrics, w = self._collect(req)
                queue.popleft()
                waited += w
                wait_train += gen_metrics.pop("timing/wait_train", 0.0)
                self._add_gen_metrics(metrics, gen_metrics)
                oldest = int(out.batch[keys.POLICY_VERSION].min())  # = req.version under abort
                if (step - 1) - oldest > self.max_staleness:  # drop and resubmit with the newest weights
                    self._aborted += len(req.prompts)
                    self._outstanding -= len(req.prompts)
                    pending.appendleft((req.prompts, step, req.source))
                    fill()
                    continue
                consumed += len(req.prompts)
                requests += 1
                self._mark_trained(req.source)
                if groups is None:
                    parts.append(out)
                    have += len(req.prompts)
                else:  # no longer outstanding: while filtering empties the queue, fill() may submit more
                    self._outstanding -= len(req.prompts)
                    out, seconds = self._score(out, scored)
                    reward_s += seconds
                    groups.add(out)
            if groups is None:
                self._outstanding -= have
                batch = DataProto.concat(parts)
            else:
                metrics |= combine_reward_metrics(scored) | {"timing/reward": reward_s}
                batch = groups.batch(metrics, consumed / self.batch_prompts)
            batch.meta_info.pop("metrics", None)
            metrics |= {"timing/wait_rollout": waited, "timing/wait_train": wait_train,
                        "async/aborted_prompts": float(self._aborted), "async/requests": float(requests)}
            yield self._ready(batch, step, metrics)
            yielded = step
            fill()  # after the step's update: new requests get its weights


def build_driver(alg: PPOAlgorithm) -> RolloutDriver | None:
    """The driver of `trainer.mode` (None in sync mode: the PPO step generates on the hybrid actor itself)."""
    mode = alg.cfg.trainer.mode
    if mode == "sync":
        return None
    return OneStepOffDriver(alg) if mode == "one_step_off" else AsyncDriver(alg)
