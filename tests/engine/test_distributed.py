"""World size 1 vs 2 (gloo, spawned processes): the same loss, gradient norm and updated weights."""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ranks_testlib import start_ranks
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor

HERE = str(Path(__file__).parent)


def _train_and_dump(rank: int, world: int, out: str, overrides: list[str]) -> None:
    sys.path.insert(0, HERE)
    from engine_testlib import logprobs, make_batch, make_engine, nll_loss, train_step

    from hybridflow.engine.checkpoint import full_model_state

    engine = make_engine(*overrides)
    if "actor.fsdp.defer_grad_sync=true" in overrides:
        assert engine._defer_grad_sync  # N ranks too: one reduce-scatter per mini-batch
    data = make_batch(batch=8, seed=11).chunk(world)[rank]  # the dispatcher's DP split
    metrics = [train_step(engine, data, nll_loss) for _ in range(2)]
    logp = logprobs(engine, data)["log_probs"]
    exported = full_model_state(engine.module, keep=rank == 0)  # the exporter's gather: rank 0 keeps the only copy
    assert (exported == {}) == (rank != 0)
    weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous()
               for n, p in engine.module.named_parameters()}
    if rank == 0:
        weights.update({f"_export.{n}": t.clone() for n, t in exported.items()})
        weights["_loss"] = torch.tensor([m["loss"] for m in metrics])
        weights["_grad_norm"] = torch.tensor([m["grad_norm"] for m in metrics])
        if any("aux_loss" in o for o in overrides):  # averaged over micro-batches and ranks
            weights["_moe_aux_loss"] = torch.tensor([m["moe/aux_loss"] for m in metrics])
        save_file(weights, f"{out}/w{world}.safetensors")
    save_file({"logp": logp.contiguous()}, f"{out}/logp{world}_{rank}.safetensors")


def _worker(rank: int, world: int, out: str, overrides: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store{world}", rank=rank, world_size=world)
    _train_and_dump(rank, world, out, overrides)
    # Both ranks past their last collective before the group goes: a rank that tore gloo down while its peer was
    # still in one aborted once ("terminate called without an active exception", fresh-clone run at b8bbe7d).
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("overrides", [
    ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=30"],
    ["actor.ppo_micro_batch_size_per_gpu=1", "actor.fsdp.defer_grad_sync=true"],
    # the MoE load-balancing loss: the same micro-batches either way, weighted by the real tokens of all ranks
    ["model.preset=tiny-moe", "actor.moe.aux_loss_coef=0.5", "actor.ppo_micro_batch_size_per_gpu=2"],
], ids=["token-budget", "deferred-sync", "moe-aux-loss"])
def test_world_size_1_and_2_agree(tmp_path, overrides, dist_group):
    start_ranks(_worker, (2, str(tmp_path), overrides), 2)
    _train_and_dump(0, 1, str(tmp_path), overrides)  # world size 1: this process's 1-rank group
    one, two = load_file(tmp_path / "w1.safetensors"), load_file(tmp_path / "w2.safetensors")
    torch.testing.assert_close(one["_loss"], two["_loss"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one["_grad_norm"], two["_grad_norm"], atol=1e-5, rtol=1e-5)
    for name in one:
        torch.testing.assert_close(one[name], two[name], atol=1e-5, rtol=0, msg=name)
        if not name.startswith("_"):  # the exported state is the trained weights
            assert torch.equal(two[f"_export.{name}"], two[name]), name
    logp_two = torch.cat([load_file(tmp_path / f"logp2_{r}.safetensors")["logp"] for r in range(2)])
    torch.testing.assert_close(load_file(tmp_path / "logp1_0.safetensors")["logp"], logp_two, atol=1e-5, rtol=1e-5)


def _count_reduce_scatters(rank: int, out: str) -> None:
    """Each rank: reduce-scatter calls in one train_step of 4 micro-batches, with and without deferral."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store_rs", rank=rank, world_size=2)
    sys.path.insert(0, HERE)
    from engine_testlib import make_batch, make_engine, nll_loss, train_step

    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    original, calls = getattr(dist, name), []

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    setattr(dist, name, counting)  # FSDP2 calls it through the torch.distributed module
    counts = {}
    for defer in ("true", "false"):
        engine = make_engine("actor.ppo_micro_batch_size_per_gpu=1", f"actor.fsdp.defer_grad_sync={defer}")
        calls.clear()
        train_step(engine, make_batch(batch=8, seed=11).chunk(2)[rank], nll_loss)
        counts[defer] = len(calls)
    save_file({"counts": torch.tensor([counts["true"], counts["false"]])}, f"{out}/rs{rank}.safetensors")
    dist.destroy_process_group()


def test_deferred_sync_reduce_scatters_once_per_mini_batch(tmp_path):
    """Two ranks, 4 micro-batches each: deferral reduce-scatters each FSDP group once, not once per micro-batch."""
    start_ranks(_count_reduce_scatters, (str(tmp_path),), 2)
    for rank in range(2):
        deferred, synced = load_file(tmp_path / f"rs{rank}.safetensors")["counts"].tolist()
        assert deferred > 0 and synced == 4 * deferred, (rank, deferred, synced)
