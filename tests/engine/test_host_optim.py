"""`fsdp.optimizer_offload=cpu_step` (engine/host_optim.py): on the CPU in fp32 the host step is the device step
bit for bit — weights, Adam moments, step counts, LR, metrics — with clipping, weight decay, warm-up, several
mini-batches, the non-finite skip, LoRA, a checkpoint resume and 2 gloo ranks; with a bf16 compute dtype the module
holds only bf16 weights and the fp32 masters live in the host optimizer. The GPU run's kind (fused AdamW, bf16
gradients widened in chunks) and the ordering of its pipelined copies are checked on the CPU too."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from engine_testlib import load_engine, make_batch, make_engine, nan_loss, nll_loss, save_engine, train_step
from ranks_testlib import start_ranks
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from hybridflow.checkpoint import CheckpointManager
from hybridflow.config import load_config
from hybridflow.engine import host_optim

HERE = str(Path(__file__).parent)
CPU_STEP = "actor.fsdp.optimizer_offload=cpu_step"
# gradient clipping active (the norms here are 3-5), weight decay and a warm-up: every term of the step counts
CLIPPED = ("actor.grad_clip=0.5", "actor.optim.weight_decay=0.1", "actor.optim.lr_warmup_steps=2")
LORA = ("model.lora.rank=4", "model.lora.alpha=8")


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else torch.as_tensor(t)


def _snapshot(engine) -> dict[str, torch.Tensor]:
    """Checkpoint entries (master weights, Adam state), the module's weights, the LR: flat, local shards."""
    state = engine.state_dict()
    out = {f"model/{k}": _local(v).clone() for k, v in state["model"].items()}
    for fqn, s in state["optimizer"]["state"].items():
        out |= {f"optim/{fqn}/{k}": _local(v).clone() for k, v in s.items()}
    out |= {f"module/{n}": _local(p).detach().clone() for n, p in engine.module.named_parameters()}
    out["lr"] = torch.tensor([g["lr"] for g in engine.optimizer.param_groups], dtype=torch.float64)
    out["global_step"] = torch.tensor(engine.global_step)
    return out


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    differ = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} entries differ, e.g. {differ[:5]}"


def _train(engine, steps: int, seed: int = 3) -> list[dict[str, float]]:
    data = make_batch(8, seed=seed)
    return [train_step(engine, data, nll_loss, mini_batch_size=4) for _ in range(steps)]  # 2 optimizer steps each


@pytest.mark.parametrize("extra", [(), LORA], ids=["full", "lora"])
def test_host_step_is_bitwise_the_device_step(extra, dist_group):
    device, host = make_engine(*CLIPPED, *extra), make_engine(*CLIPPED, *extra, CPU_STEP)
    assert host.host_optimizer is not None and device.host_optimizer is None
    trained = [p for p in host.module.parameters() if p.requires_grad]
    assert len(host.host_optimizer.masters) == len(trained)
    if extra == LORA:  # adapters only: the frozen base has no master copy and no optimizer state
        assert len(trained) < len(list(host.module.parameters()))
    m_device, m_host = _train(device, 3), _train(host, 3)
    assert [m["loss"] for m in m_device] == [m["loss"] for m in m_host]
    assert [m["grad_norm"] for m in m_device] == [m["grad_norm"] for m in m_host]
    assert all(m["grad_norm"] > 0.5 for m in m_host)  # clipping was active
    _assert_bitwise(_snapshot(device), _snapshot(host))


def test_host_step_skips_a_non_finite_step(dist_group):
    device, host = make_engine(*CLIPPED), make_engine(*CLIPPED, CPU_STEP)
    for engine in (device, host):
        _train(engine, 1)
    before = _snapshot(host)
    metrics = train_step(host, make_batch(8, seed=4), nan_loss)
    assert metrics["skipped"] == 1.0
    after = _snapshot(host)
    _assert_bitwise({k: v for k, v in before.items() if k not in ("lr", "global_step")},
                    {k: v for k, v in after.items() if k not in ("lr", "global_step")})
    assert host.host_optimizer.masters[0].grad is None and all(p.grad is None for p in host.module.parameters())
    train_step(device, make_batch(8, seed=4), nan_loss)
    for engine in (device, host):  # the skip leaves nothing behind: the next steps agree too
        _train(engine, 1, seed=5)
    _assert_bitwise(_snapshot(device), _snapshot(host))


def test_host_step_resumes_bitwise_from_a_checkpoint(tmp_path, dist_group):
    cosine = (*CLIPPED, "actor.optim.lr_scheduler=cosine", "actor.optim.min_lr_ratio=0.1")
    straight = make_engine(*cosine, CPU_STEP, total_training_steps=6)
    _train(straight, 4)
    first = make_engine(*cosine, CPU_STEP, total_training_steps=6)
    _train(first, 2)
    save_engine(first, tmp_path / "ckpt")
    resumed = make_engine(*cosine, CPU_STEP, total_training_steps=6)
    load_engine(resumed, tmp_path / "ckpt")
    assert resumed.global_step == 2
    _train(resumed, 2)
    _assert_bitwise(_snapshot(straight), _snapshot(resumed))


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_host_step_resumes_bitwise_through_the_trainers_checkpoints(tmp_path, async_save, dist_group):
    """The run-level path (CheckpointManager: flattened state, async staging, load into templates)."""
    straight = make_engine(*CLIPPED, CPU_STEP)
    _train(straight, 3)
    first = make_engine(*CLIPPED, CPU_STEP)
    _train(first, 2)
    with CheckpointManager(tmp_path, async_save=async_save, capture_rng=False) as mgr:
        mgr.save(2, {"actor": first.state_dict()})
    _train(first, 1)  # training on while an async save writes must not change what it wrote
    resumed = make_engine(*CLIPPED, CPU_STEP)
    loaded = CheckpointManager(tmp_path, capture_rng=False).load(tmp_path / "global_step_2",
                                                                 templates={"actor": resumed.state_dict()})
    resumed.load_state_dict(loaded.components["actor"])
    _train(resumed, 1)
    _assert_bitwise(_snapshot(straight), _snapshot(resumed))


@pytest.mark.parametrize("micro", [4, 1], ids=["one-micro-batch", "deferred-sum-of-4"])
def test_compute_dtype_weights_on_the_module_fp32_masters_on_the_host(micro, dist_group):
    engine = make_engine("model.dtype=bfloat16", "actor.optim.lr=3e-3", f"actor.ppo_micro_batch_size_per_gpu={micro}",
                         CPU_STEP)
    host = engine.host_optimizer
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    assert {m.dtype for m in host.masters} == {torch.float32}
    assert all(s["exp_avg"].dtype == torch.float32 for s in engine.optimizer.state.values())
    assert not any(p in engine.optimizer.state for p in engine.module.parameters())  # no state on the module
    losses = [m["loss"] for m in _train(engine, 6)]
    assert losses[-1] < losses[0] - 0.5, losses
    for p, m in zip(host.params, host.masters):  # the module holds the masters rounded to bf16
        assert torch.equal(_local(p), m.detach().to(torch.bfloat16))
    assert engine.state_dict()["model"][host.fqns[0]].dtype == torch.float32  # checkpoints keep the masters


@pytest.mark.parametrize("max_norm", [0.1, 100.0], ids=["clipped", "not-clipped"])
def test_fused_host_step_matches_clip_then_adamw(max_norm):
    """The kind a GPU run uses (fused AdamW, the clip folded into its grad_scale; bf16 gradients widened in
    chunks) against clip_grads_with_norm_ + fused AdamW on fp32 copies: equal to rounding."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    optim = load_config(files=[], overrides=["actor.optim.weight_decay=0.1"]).actor.optim
    masters = host_optim.cut_masters(model, torch.float32, 0, 1)
    ref = [torch.nn.Parameter(m.clone()) for m in masters.values()]
    host_optim.cast_params(model, torch.bfloat16)
    host = host_optim.HostOptimizer(model, masters, optim, fused=True)
    host.chunks = host_optim._chunks([m.numel() for m in host.masters], 270)  # several chunks, a large one alone
    assert len(host.chunks) > 2
    ref_optim = torch.optim.AdamW(ref, lr=optim.lr, weight_decay=0.1, fused=True)
    for _ in range(3):
        grads = [torch.randn(p.shape).to(torch.bfloat16) for p in host.params]
        for p, g, r in zip(host.params, grads, ref):
            p.grad, r.grad = g, g.float()
        norm = torch.nn.utils.get_total_norm([g.float() for g in grads])
        torch.nn.utils.clip_grads_with_norm_(ref, max_norm, norm)
        ref_optim.step()
        host.step(norm, max_norm, skip=False)
        for p, m, r in zip(host.params, host.masters, ref):
            torch.testing.assert_close(m.detach(), r.detach(), rtol=2e-6, atol=1e-7)
            assert torch.equal(p.detach(), m.detach().to(torch.bfloat16)) and p.grad is None
    for m, r in zip(host.masters, ref):
        torch.testing.assert_close(host.optimizer.state[m]["exp_avg_sq"], ref_optim.state[r]["exp_avg_sq"],
                                   rtol=2e-6, atol=1e-12)


class _Lane:
    """A side stream that runs nothing until someone waits: copies queue up, events mark positions."""

    def __init__(self) -> None:
        self.queue: list = []
        self.done = 0

    def flush(self, upto: int | None = None) -> None:
        upto = len(self.queue) if upto is None else upto
        while self.done < upto:
            item, self.done = self.queue[self.done], self.done + 1
            item()


class _Event:
    def __init__(self, lane: _Lane) -> None:
        self.lane, self.at = lane, len(lane.queue)

    def __call__(self) -> None:
        self.lane.flush(self.at)


class _Queue(TorchFunctionMode):
    def __init__(self, lane: _Lane) -> None:
        super().__init__()
        self.lane = lane

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and kwargs.get("non_blocking"):
            dst, src = args
            self.lane.queue.append(lambda: dst.copy_(src))  # reads `src` when it runs, as a device copy would
            return dst
        return func(*args, **kwargs)


class DeferredLanes(host_optim._Lanes):
    """The pipeline's protocol with maximal asynchrony: a copy runs only once an event after it is waited for
    (or a stream that waits on that event runs), so a missing wait reads or overwrites a staging buffer early."""

    def __init__(self, honour_waits: bool = True) -> None:
        self.d2h, self.h2d, self.honour = _Lane(), _Lane(), honour_waits

    def to_host(self, after=None):
        if after is not None:
            self.d2h.queue.append(after)
        return _Queue(self.d2h)

    def to_device(self):
        return _Queue(self.h2d)

    def mark_to_host(self):
        return _Event(self.d2h)

    def mark_to_device(self):
        return _Event(self.h2d)

    def wait(self, event) -> None:
        if self.honour:
            event()

    def main_after_both(self) -> None:
        self.h2d.flush()
        self.d2h.flush()


@pytest.mark.parametrize("honour_waits", [True, False], ids=["ordered", "control-without-waits"])
def test_pipelined_copies_are_ordered_by_their_events(honour_waits):
    """The GPU path's ordering (two staging buffers, copies on side streams) checked on the CPU with lanes whose
    copies run as late as the events allow: the result equals the in-order run; without the waits it does not
    (the check can fail)."""
    torch.manual_seed(0)
    optim = load_config(files=[]).actor.optim
    runs = []
    for lanes in (None, DeferredLanes(honour_waits)):
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8), torch.nn.Linear(8, 8))
        torch.manual_seed(1)
        for p in model.parameters():
            p.data = torch.randn(p.shape)
        masters = host_optim.cut_masters(model, torch.float32, 0, 1)
        host_optim.cast_params(model, torch.bfloat16)
        host = host_optim.HostOptimizer(model, masters, optim, fused=True)
        host.chunks = host_optim._chunks([m.numel() for m in host.masters], 270)
        host._lanes_ = lanes
        torch.manual_seed(2)
        for _ in range(3):
            for p in host.params:
                p.grad = torch.randn(p.shape).to(torch.bfloat16)
            host.step(torch.tensor(2.0), 1.0, skip=False)
        runs.append([p.detach().clone() for p in host.params] + [m.detach().clone() for m in host.masters])
    assert len(host.chunks) >= 4  # every staging buffer is reused
    same = all(torch.equal(a, b) for a, b in zip(*runs))
    assert same == honour_waits


def test_optimizer_offload_values_are_checked():
    assert load_config(files=[], overrides=[CPU_STEP]).actor.fsdp.cpu_step
    assert not load_config(files=[], overrides=["actor.fsdp.optimizer_offload=true"]).actor.fsdp.cpu_step
    with pytest.raises(ValueError, match="optimizer_offload='cpu'.*true, false or cpu_step"):
        load_config(files=[], overrides=["actor.fsdp.optimizer_offload=cpu"])


def _two_rank_worker(rank: int, out: str) -> None:
    sys.path.insert(0, HERE)
    from engine_testlib import make_batch as batch
    from engine_testlib import make_engine as engine_of
    from engine_testlib import train_step as step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2)
    data = batch(8, seed=11).chunk(2)[rank]
    snaps, metrics = [], []
    for extra in ((), (CPU_STEP,)):
        engine = engine_of(*CLIPPED, "actor.ppo_micro_batch_size_per_gpu=1", *extra)
        metrics.append([step(engine, data, nll_loss, mini_batch_size=2) for _ in range(2)])
        snaps.append(_snapshot(engine))
    differ = [k for k in snaps[0] if not torch.equal(snaps[0][k], snaps[1].get(k, torch.empty(0)))]
    same_metrics = [[m["loss"], m["grad_norm"]] for m in metrics[0]] == [[m["loss"], m["grad_norm"]] for m in metrics[1]]
    Path(out, f"rank{rank}.json").write_text(json.dumps({"differ": differ, "same_metrics": same_metrics,
                                                         "entries": len(snaps[0])}))
    dist.barrier()
    dist.destroy_process_group()


def test_host_step_on_two_ranks_is_bitwise_the_device_step(tmp_path):
    start_ranks(_two_rank_worker, (str(tmp_path),), 2)
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["entries"] > 0 and result["same_metrics"], result
        assert result["differ"] == [], result
