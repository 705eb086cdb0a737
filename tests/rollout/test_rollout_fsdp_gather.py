"""FSDP2 over 2 ranks (gloo, CPU): the engine gathers full weights one FSDP2 group (layer) at a time into reused
buffers and generates exactly what the unsharded model generates."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from ranks_testlib import start_ranks
from rollout_helpers import EOS, PAD, make_engine, make_model, make_prompts

from hybridflow.engine.fsdp import apply_fsdp2, build_mesh


def _worker(rank: int, out_dir: str) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=2)
    try:
        model = make_model("qwen")
        apply_fsdp2(model, build_mesh(torch.device("cpu")), torch.float32, torch.float32)
        engine = make_engine(model, 10, 8)
        engine.sync_weights()
        w = engine._weights
        assert w.owned_buffers and w.layers[0].q.shape == (128, 128), w.layers[0].q.shape
        prompts = make_prompts(3, 10, model.config.vocab_size, meta={"do_sample": False})
        tokens = engine.generate(prompts).batch["responses"]
        ptr = w.layers[0].q.data_ptr()
        engine.sync_weights()  # second sync reuses the gather buffers
        assert engine._weights.layers[0].q.data_ptr() == ptr
        layer = model.model.layers[0]  # gathering = one FSDP2 unshard per layer, not a collective per parameter
        with engine._view._fsdp_unsharded(layer):
            assert not hasattr(layer.self_attn.q_proj.weight, "to_local")
        assert hasattr(layer.self_attn.q_proj.weight, "to_local")  # resharded afterwards
        torch.save(tokens, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_rank_fsdp_gather_matches_unsharded(tmp_path):
    start_ranks(_worker, (str(tmp_path),), 2)
    model = make_model("qwen")
    prompts = make_prompts(3, 10, model.config.vocab_size)
    with torch.no_grad():
        ref = model.generate(input_ids=prompts.batch["input_ids"], attention_mask=prompts.batch["attention_mask"],
                             max_new_tokens=8, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)[:, 10:]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got[:, : ref.shape[1]], ref), (rank, got, ref)
