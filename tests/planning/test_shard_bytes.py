"""The planner's per-rank parameter, gradient and Adam-state bytes equal what FSDP2 ranks hold (gloo, 2 and 4 CPU
ranks, uneven row counts so that torch.chunk gives the last rank fewer rows): exact equality, rank by rank."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridflow.engine.fsdp import apply_fsdp2
from hybridflow.planning.memory import EngineSettings
from hybridflow.planning.model_shape import ModelShape

# Rows not divisible by 4: intermediate 90 and vocab 203 (q 6·8 = 48 and k/v 3·8 = 24 are)
HF = dict(vocab_size=203, hidden_size=32, intermediate_size=90, num_hidden_layers=2, num_attention_heads=6,
          num_key_value_heads=3, head_dim=8, tie_word_embeddings=False)


def _held(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, int]:
    local = [p.to_local() for p in model.parameters()]
    grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    states = [t.to_local() if hasattr(t, "to_local") else t for s in optim.state.values()
              for k, t in s.items() if k != "step"]
    return {name: sum(t.numel() * t.element_size() for t in ts)
            for name, ts in (("params", local), ("grads", grads), ("optimizer", states))}


def _rank(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=4)
    pair = dist.new_group([0, 1])
    meshes = {4: DeviceMesh.from_group(dist.group.WORLD, "cpu")}
    if rank < 2:
        meshes[2] = DeviceMesh.from_group(pair, "cpu")
    result = {}
    for world, mesh in meshes.items():
        torch.manual_seed(0)
        model = apply_fsdp2(Qwen2ForCausalLM(Qwen2Config(**HF)), mesh, torch.float32, torch.float32)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.randint(0, HF["vocab_size"], (2, 5))
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        result[world] = _held(model, optim)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _launch(out: str) -> None:
    """In a fresh interpreter (no process group or threads from earlier tests to fork), fork the four ranks: they
    start with torch and transformers already imported (seconds, not a minute, on 2 busy cores)."""
    mp.start_processes(_rank, args=(out,), nprocs=4, start_method="fork")


def test_planner_shard_bytes_equal_fsdp2_ranks(tmp_path):
    root = Path(__file__).resolve().parents[2]
    code = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_shard_bytes as t; " \
           f"t._launch({str(tmp_path)!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=600,
                          env=os.environ | {"PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    shape = ModelShape.from_hf({**HF, "model_type": "qwen2"})
    for world in (2, 4):
        for rank in range(world):
            held = json.loads((tmp_path / f"rank{rank}.json").read_text())[str(world)]
            e = EngineSettings(role="actor", shape=shape, master_bytes=4, compute_bytes=4, world=world, rank=rank)
            planned = {"params": e.param_bytes(), "grads": e.grad_bytes(), "optimizer": e.optimizer_gpu_bytes()}
            assert planned == held, (world, rank)
    # the uneven rows really are uneven: rank 0 holds more than the last rank
    last = json.loads((tmp_path / "rank3.json").read_text())["4"]
    assert json.loads((tmp_path / "rank0.json").read_text())["4"]["params"] > last["params"]
