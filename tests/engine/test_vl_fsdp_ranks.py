"""Two gloo ranks training tiny-vl under FSDP2 where only rank 0's micro-batch holds an image: the vision tower
(in the root FSDP group) must get a gradient on both ranks, or their reduce-scatters differ and the update hangs."""

import datetime
import io
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from ranks_testlib import run_ranks
from torch.distributed.tensor import DTensor

HERE = str(Path(__file__).parent)
P, RESPONSE = 48, [5, 6, 7, 8]


def _png(side: int) -> dict:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return {"bytes": buf.getvalue()}


def _batch(with_image: bool):
    """One prompt (with an image or text-only) and a fixed response, in the engine's layout; also the prompt alone."""
    from hybridflow.data import collate_rl
    from hybridflow.data.rl_dataset import RLHFDataset
    from hybridflow.models.tiny_vl import tiny_vl_image_processor, tiny_vl_tokenizer
    from hybridflow.protocol import keys

    row = {"prompt": "<image>How many red?", "images": [_png(16)]} if with_image else {"prompt": "Just text here."}
    tok = tiny_vl_tokenizer()
    ds = RLHFDataset([row | {"reward_model": {"ground_truth": "1"}}], tok, max_prompt_length=P,
                     image_processor=tiny_vl_image_processor())
    prompts = collate_rl([ds[0]], pad_token_id=tok.pad_token_id, pad_to=P)
    batch = collate_rl([ds[0]], pad_token_id=tok.pad_token_id, pad_to=P)
    response = torch.tensor([RESPONSE])
    ids = torch.cat([batch.batch[keys.INPUT_IDS], response], 1)
    mask = torch.cat([batch.batch[keys.ATTENTION_MASK], torch.ones_like(response)], 1)
    batch.batch.update({keys.INPUT_IDS: ids, keys.ATTENTION_MASK: mask, keys.RESPONSES: response,
                        keys.POSITION_IDS: (mask.cumsum(-1) - 1).clamp(min=0),
                        keys.RESPONSE_MASK: torch.ones_like(response)})
    return prompts, batch


def _generate(engine, prompts, name: str) -> None:
    """Greedy generation of a fixed length with the actor's FSDP2 module (rollout.name=hybrid: our engine, hf: HF
    generate); both gather the vision tower on every rank."""
    import dataclasses

    from hybridflow.config import load_config
    from hybridflow.models.tiny_vl import tiny_vl_tokenizer
    from hybridflow.rollout import RolloutEngine

    tok = tiny_vl_tokenizer()
    cfg = dataclasses.replace(load_config([], []).rollout, name=name, free_cache_engine=False)
    rollout = RolloutEngine(engine.module, cfg, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                            max_prompt_length=P, max_response_length=len(RESPONSE))
    prompts.meta_info = {"do_sample": False, "ignore_eos": True}
    rollout.generate(prompts)
    rollout.release_cache()


def _tower(engine) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in engine.module.named_parameters() if ".visual." in f".{n}"}


def _worker(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    # A mismatched collective fails after the timeout instead of hanging the rank for good.
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    sys.path.insert(0, HERE)
    from engine_testlib import make_engine, nll_loss, train_step

    from hybridflow.engine import HeadRequest

    engine = make_engine("model.preset=tiny-vl", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=1")
    prompts, data = _batch(with_image=rank == 0)
    for name in ("hybrid", "hf"):
        _generate(engine, prompts, name)
    logp = engine.infer(data, HeadRequest("lm"))["log_probs"]  # forward only: the same all-gathers on both ranks
    before = _tower(engine)
    train_step(engine, data, nll_loss)
    after = _tower(engine)
    torch.save({"finite": bool(torch.isfinite(logp).all()), "before": before, "after": after}, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_update_with_an_image_on_one_rank_only(tmp_path):
    run_ranks(_worker, (str(tmp_path),), 2, 240, "the reduce-scatters of the two ranks differed?")
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert got[0]["finite"] and got[1]["finite"]
    (before0, after0), (before1, after1) = ((g["before"], g["after"]) for g in got)
    assert before0 and before0.keys() == after1.keys()
    for name in before0:
        assert torch.equal(before0[name], before1[name]), name
        assert torch.equal(after0[name], after1[name]), name
    moved = [n for n in before0 if not torch.equal(before0[n], after0[n])]
    assert len(moved) == len(before0), sorted(set(before0) - set(moved))
