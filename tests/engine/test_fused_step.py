"""The fused optimizer's device-side skip (the CUDA path, run here on the CPU): a non-finite step leaves weights,
Adam moments and step counts exactly as they were without reading the flag on the host, and finite steps match
the multi-tensor (foreach) optimizer the CPU uses, up to rounding."""

import pytest
import torch
from engine_testlib import load_engine, make_batch, make_engine, nan_loss, nll_loss, save_engine, train_step
from torch.distributed.tensor import DTensor

import hybridflow.engine.train_engine as train_engine
from hybridflow.engine.optim import is_fused

pytestmark = pytest.mark.usefixtures("dist_group")


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _state(engine):
    """Weights and every optimizer state tensor, by parameter name."""
    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = _full(p)
        for key, value in engine.optimizer.state.get(p, {}).items():
            out[f"{name}/{key}"] = _full(value)
    return out


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setattr(train_engine, "_wants_fused_optimizer", lambda device: True)


def test_fused_skip_keeps_weights_moments_and_step_counts(fused):
    engine = make_engine()
    assert is_fused(engine.optimizer)
    data = make_batch(seed=5)
    assert train_step(engine, data, nll_loss)["skipped"] == 0
    before = _state(engine)
    assert any(k.endswith("/exp_avg") for k in before)

    metrics = train_step(engine, data, nan_loss)
    assert metrics["skipped"] == 1
    after = _state(engine)
    assert before.keys() == after.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed == []
    assert train_step(engine, data, nll_loss)["skipped"] == 0
    assert not torch.equal(_state(engine)[next(iter(before))], before[next(iter(before))])


def test_fused_steps_match_foreach_steps(monkeypatch):
    data = [make_batch(seed=s) for s in (1, 2, 3)]
    runs = {}
    for fused in (False, True):
        monkeypatch.setattr(train_engine, "_wants_fused_optimizer", lambda device, f=fused: f)
        engine = make_engine("actor.optim.weight_decay=0.01", "actor.grad_clip=0.5")
        assert is_fused(engine.optimizer) == fused
        losses = [train_step(engine, d, nll_loss)["loss"] for d in data]
        runs[fused] = losses, _state(engine)
    (l0, s0), (l1, s1) = runs[False], runs[True]
    assert l0[0] == l1[0]  # the same weights before the first step
    assert l1 == pytest.approx(l0, rel=1e-4)
    for k in s0:
        torch.testing.assert_close(s1[k], s0[k], rtol=1e-4, atol=1e-6, msg=k)


CUDA_SCRIPT = r'''
import sys, torch, torch.distributed as dist
sys.path.insert(0, "tests/engine")
from engine_testlib import make_batch, make_config, nan_loss, nll_loss
from hybridflow.engine import TrainEngine, UpdatePlan, train_update, HeadRequest
from hybridflow.engine.optim import is_fused
from hybridflow.workers.engine_specs import actor_spec
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
engine = TrainEngine(actor_spec(make_config()), device="cuda")
assert is_fused(engine.optimizer)
head, data = HeadRequest("lm", 1.0, 1024, False), make_batch(seed=5)
step = lambda fn: train_update(engine, data, fn, head, UpdatePlan(len(data)))
def state():
    out = []
    for p in engine.module.parameters():
        out.append(p.full_tensor().clone())
        out += [v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
                for v in engine.optimizer.state[p].values()]
    return out
assert step(nll_loss)["skipped"] == 0
before = state()
assert step(nan_loss)["skipped"] == 1
assert all(torch.equal(a, b) for a, b in zip(before, state()))
assert step(nll_loss)["skipped"] == 0
assert not all(torch.equal(a, b) for a, b in zip(before, state()))
dist.destroy_process_group()
print("fused cuda ok")
'''


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused optimizer's CUDA path needs a GPU")
def test_fused_skip_on_cuda_with_fsdp2():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", CUDA_SCRIPT], cwd=root, capture_output=True, text=True, timeout=300,
                          env=os.environ | {"PYTHONPATH": str(root)})
    assert proc.returncode == 0 and "fused cuda ok" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("saved_fused", [False, True])
def test_a_checkpoint_of_the_other_optimizer_kind_loads_and_steps(saved_fused, monkeypatch, tmp_path):
    """torch's load_state_dict brings the saved groups' fused/foreach flags: a CPU (foreach) checkpoint resumed by a
    fused engine must still step and skip with the fused kernel, and a fused checkpoint resumed on the CPU with
    foreach; the weights and moments are the saved ones."""
    data = make_batch(seed=5)
    monkeypatch.setattr(train_engine, "_wants_fused_optimizer", lambda device: saved_fused)
    saver = make_engine()
    train_step(saver, data, nll_loss)
    save_engine(saver, tmp_path / "ckpt")
    saved = _state(saver)

    monkeypatch.setattr(train_engine, "_wants_fused_optimizer", lambda device: not saved_fused)
    engine = make_engine()
    load_engine(engine, tmp_path / "ckpt")
    assert is_fused(engine.optimizer) == (not saved_fused)
    assert all((g["fused"], g["foreach"]) == ((True, None) if not saved_fused else (None, True))
               for g in engine.optimizer.param_groups)
    loaded = _state(engine)
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)

    assert train_step(engine, data, nan_loss)["skipped"] == 1
    assert all(torch.equal(v, saved[k]) for k, v in _state(engine).items())
    assert train_step(engine, data, nll_loss)["skipped"] == 0
    steps = [s["step"] for s in engine.optimizer.state.values()]
    assert steps and all(float(s) == 2.0 for s in steps)  # one saved step + this one; the skipped one not counted


PREFETCH_SCRIPT = r'''
import sys, torch, torch.distributed as dist
sys.path.insert(0, "tests/engine")
from engine_testlib import make_batch, make_config, nll_loss
from hybridflow.engine import TrainEngine, UpdatePlan, train_update, HeadRequest
from hybridflow.workers.engine_specs import actor_spec
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
head, batches = HeadRequest("lm", 1.0, 1024, False), [make_batch(seed=s) for s in (1, 2, 3)]
def run(offload):
    engine = TrainEngine(actor_spec(make_config(f"actor.fsdp.optimizer_offload={offload}")), device="cuda")
    places = []
    for data in batches:
        engine.to_mode("generate")
        engine.to_mode("train")
        places.append({v.device.type for s in engine.optimizer.state.values() for v in s.values()
                       if torch.is_tensor(v) and v.dim()})
        engine.infer(data, head)  # a log-prob pass before the update: the parked state stays parked
        train_update(engine, data, nll_loss, head, UpdatePlan(len(data)))
    torch.cuda.synchronize()  # the parked state's copy to the host is asynchronous (pinned memory)
    local = lambda t: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()  # one rank: the whole tensor
    weights = [local(p) for p in engine.module.parameters()]
    moments = [local(v) for s in engine.optimizer.state.values() for k, v in s.items() if k != "step"]
    return weights, moments, places
w0, m0, p0 = run("false")
w1, m1, p1 = run("true")
assert all(torch.equal(a, b) for a, b in zip(w0, w1)), "weights differ"
assert all(torch.equal(a, b.to(a.device)) for a, b in zip(m0, m1)), "moments differ"
assert p0[1:] == [{"cuda"}] * 2 and p1[1:] == [{"cpu"}] * 2, (p0, p1)
print("prefetch ok")
'''


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the optimizer state is parked in pinned host memory")
def test_parked_optimizer_state_comes_back_for_the_update_only_and_steps_the_same():
    """optimizer_offload=true: after generation the Adam state stays on the CPU through the log-prob passes and
    returns when the update starts; the weights and moments equal those of the state kept on the GPU, bit for
    bit."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", PREFETCH_SCRIPT], cwd=root, capture_output=True, text=True,
                          timeout=300, env=os.environ | {"PYTHONPATH": str(root)})
    err = "\n".join(line for line in proc.stderr.splitlines() if "registered at" not in line)  # no dispatch table
    assert proc.returncode == 0 and "prefetch ok" in proc.stdout, proc.stdout[-3000:] + err[-3000:]
