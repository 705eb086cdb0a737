"""One update of a `TrainEngine`: epochs × mini-batches of `forward_backward` + `step`, then one LR-schedule step.

Decision: this is the only training loop over an engine — PPO's actor and critic (several epochs and mini-batches)
and the supervised trainers (one mini-batch = the whole batch) all call `train_update` with their own `UpdatePlan`,
loss and head. Metrics: mini-batch means, averaged over ranks except `loss`/`grad_norm` (already global),
`skipped` (optimizer steps skipped, summed) and `num_tokens` (this rank's); plus throughput, MFU and the LR.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.engine.flops import peak_flops
from hybridflow.engine.model_forward import HeadRequest
from hybridflow.engine.train_engine import LossFn, TrainEngine, host_floats
from hybridflow.protocol import DataProto

logger = logging.getLogger(__name__)

# Already the same on every rank (reduced inside the engine) or deliberately this rank's own.
_NOT_AVERAGED = ("loss", "grad_norm", "num_tokens", "skipped")
_ROW = "_update_row"  # with late columns: each row's index in the update's data


@dataclass(frozen=True)
class UpdatePlan:
    """`mini_batch_size`: SAMPLES per optimizer step on this rank (clamped to the rows this rank holds);
    `epochs` passes over the rows, reshuffled each epoch when `shuffle` (seeded by `seed` and the update count)."""

    mini_batch_size: int
    epochs: int = 1
    shuffle: bool = False
    seed: int = 0


def train_update(engine: TrainEngine, data: DataProto, loss_fn: LossFn, head: HeadRequest,
                 plan: UpdatePlan, late: Callable[[], DataProto] | None = None) -> dict[str, float]:
    """Train `engine` on this rank's `data` per `plan`; returns the update's metrics (bare names).

    `late` (`protocol.late`): returns `data` with the columns the loss needs that were not ready yet (the
    advantages, while the driver still scores); only for an update of one mini-batch and one epoch, where the
    first forward does not depend on them. Its host time is not the update's: on the CPU, where nothing runs
    meanwhile, it is left out of `step_time_s`, throughput and MFU; on a GPU it overlaps the queued forward and
    only what outlasts that forward shows in them."""
    per_gpu = min(plan.mini_batch_size, len(data))
    if len(data) % per_gpu:
        raise ValueError(f"{len(data)} samples on this rank are not divisible by the per-GPU mini-batch "
                         f"{per_gpu}; make data.train_batch_size a multiple of ppo_mini_batch_size")
    if late is not None:
        if plan.epochs != 1 or per_gpu != len(data):
            raise ValueError(f"late columns need an update of one mini-batch and one epoch, not {plan.epochs} "
                             f"epoch(s) of {len(data) // per_gpu} mini-batches")
        data = data.select().union(DataProto.from_dict({_ROW: torch.arange(len(data))}))
        late = _timed(late, late_s := [0.0])
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sums: dict[str, torch.Tensor | float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    flops = 0.0
    with engine.training():
        sync()
        start = time.perf_counter()
        seed = plan.seed * 100_003 + engine.global_step
        for mini in data.make_iterator(per_gpu, plan.epochs, seed=seed, shuffle=plan.shuffle):
            if late is not None:  # the rows of `mini`, in its (possibly shuffled) order
                rows = mini.batch.pop(_ROW)
                stats = engine.forward_backward(mini, loss_fn, head, lambda rows=rows: late().select_idxs(rows))
            else:
                stats = engine.forward_backward(mini, loss_fn, head)
            # device scalars are summed on the device: the update reads them back once, at its end
            metrics = {**stats.metrics, **engine.step(), "num_tokens": float(stats.num_tokens)}
            flops += stats.flops
            for k, v in metrics.items():
                sums[k] = sums[k] + v
                counts[k] += 1
        lr = engine.lr_scheduler_step()
    sync()
    elapsed = time.perf_counter() - start
    if late is not None and engine.device.type == "cpu":
        elapsed -= late_s[0]
    host = host_floats(sums)
    if host["skipped"]:
        logger.warning("%d of %d optimizer steps of this update skipped: non-finite loss or gradient norm (mean loss "
                       "%s, mean grad norm %s) at step %d", host["skipped"], counts["skipped"],
                       host["loss"] / counts["loss"], host["grad_norm"] / counts["grad_norm"], engine.global_step)
    out = _mean_over_ranks({k: host[k] / counts[k] for k in host}, engine)
    out.update(_perf_metrics(engine, host["num_tokens"], flops, elapsed))
    out["skipped"] = host["skipped"]
    out["lr"] = lr
    return out


def _timed(fn: Callable[[], DataProto], seconds: list[float]) -> Callable[[], DataProto]:
    def call() -> DataProto:
        start = time.perf_counter()
        try:
            return fn()
        finally:
            seconds[0] += time.perf_counter() - start

    return call


def _mean_over_ranks(metrics: dict[str, float], engine: TrainEngine) -> dict[str, float]:
    if engine.dp_size == 1 or not metrics:
        return metrics
    keys = sorted(k for k in metrics if k not in _NOT_AVERAGED)
    t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=engine.device)
    dist.all_reduce(t)
    out = dict(metrics)
    out.update({k: float(v) / engine.dp_size for k, v in zip(keys, t.tolist())})
    return out


def _perf_metrics(engine: TrainEngine, local_tokens: float, flops: float, elapsed: float) -> dict[str, float]:
    out = {"tokens_per_s_per_gpu": local_tokens / max(elapsed, 1e-9), "step_time_s": elapsed}
    peak = peak_flops(engine.device)
    if peak is not None:
        out["mfu"] = flops / (elapsed * peak)
    return out
