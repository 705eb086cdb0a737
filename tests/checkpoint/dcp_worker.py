"""Worker for test_ckpt_dcp.py: N gloo ranks train an FSDP2 model one step, save sharded via the manager, reload.

Run: python dcp_worker.py WORLD OUT_DIR ASYNC(0|1). Rank 0 writes full reference tensors to OUT_DIR/ref.safetensors.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank: int, world: int, out: str, async_save: bool) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from hybridflow.checkpoint import CheckpointManager
    from hybridflow.checkpoint.flatten import flatten_state

    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    torch.manual_seed(1 + rank)
    model(torch.randn(4, 6)).pow(2).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optimizer": osd}
    tensors, _ = flatten_state(state)
    assert any(isinstance(t, DTensor) for t in tensors.values())
    full = {k: (t.full_tensor() if isinstance(t, DTensor) else t).clone() for k, t in tensors.items()}
    if rank == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, f"{out}/ref.safetensors")

    mgr = CheckpointManager(f"{out}/ckpt", atomic_save=True, async_save=async_save, keep_last_n=2)
    mgr.save(1, {"actor": state}, extra={"world": world}, rank_state={"rank": rank})
    # training continues and changes the live shards while the save may still be running
    with torch.no_grad():
        for p in model.parameters():
            p.add_(100.0)
    mgr.save(2, {"actor": state}, extra={"world": world}, rank_state={"rank": rank})
    mgr.wait()

    # reload step 1 into the (now different) live state, in place
    msd2, osd2 = get_state_dict(model, opt)
    loaded = mgr.load(f"{out}/ckpt/global_step_1", templates={"actor": {"model": msd2, "optimizer": osd2}})
    assert loaded.rank_state == {"rank": rank} and loaded.extra == {"world": world}
    set_state_dict(model, opt, model_state_dict=loaded.components["actor"]["model"],
                   optim_state_dict=loaded.components["actor"]["optimizer"])
    after, _ = flatten_state(dict(zip(("model", "optimizer"), get_state_dict(model, opt))))
    for k, ref in full.items():
        got = after[k].full_tensor() if isinstance(after[k], DTensor) else after[k]
        assert torch.equal(got, ref), f"rank {rank}: {k} differs after reload"
    # a failure on one rank raises on every rank (no hang) and leaves no complete checkpoint
    import hybridflow.checkpoint.manager as manager_mod
    from hybridflow.checkpoint import CheckpointWriteError
    if rank == world - 1:
        def broken(_rank: int) -> str:
            raise OSError(28, "No space left on device")
        manager_mod._rank_file = broken
    sync = CheckpointManager(f"{out}/ckpt", async_save=False)
    try:
        sync.save(3, {"actor": state})
        raise AssertionError("save should have failed")
    except CheckpointWriteError as err:
        expect = "No space left" if rank == world - 1 else "another rank"
        assert expect in str(err), str(err)
    assert not os.path.exists(f"{out}/ckpt/global_step_3")
    mgr.close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    world, out, async_save = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
    os.makedirs(out, exist_ok=True)
    mp.spawn(_run, args=(world, out, async_save), nprocs=world, join=True)


if __name__ == "__main__":
    main()
