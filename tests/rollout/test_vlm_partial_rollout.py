"""Partial rollouts (trainer.async.partial_rollout=continue) with images: a prompt prefilled after new weights
arrived mid-call has its images encoded by the new vision tower, not the one that was in place when the call began."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from rollout_helpers import rollout_cfg

from hybridflow.config import load_config
from hybridflow.data import collate_rl
from hybridflow.data.rl_dataset import RLHFDataset
from hybridflow.models.loader import load_module
from hybridflow.models.tiny_vl import tiny_vl_image_processor, tiny_vl_tokenizer
from hybridflow.rollout import RolloutEngine, vision

P, R = 48, 4


def _png(side: int, seed: int) -> dict:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return {"bytes": buf.getvalue()}


def _prompts():
    rows = [{"prompt": "<image>How many red?", "images": [_png(16, 0)], "reward_model": {"ground_truth": "1"}},
            {"prompt": "<image>Which colour?", "images": [_png(16, 1)], "reward_model": {"ground_truth": "1"}}]
    tok = tiny_vl_tokenizer()
    ds = RLHFDataset(rows, tok, max_prompt_length=P, image_processor=tiny_vl_image_processor())
    prompts = collate_rl([ds[i] for i in range(len(ds))], pad_token_id=tok.pad_token_id)
    prompts.meta_info = {"do_sample": False, "ignore_eos": True}  # every response R tokens long
    return prompts


def _model():
    return load_module(load_config([], ["model.preset=tiny-vl"]).model, "lm").eval().requires_grad_(False)


def _new_tower(module) -> None:
    """New weights for the vision tower only (the language model stays): only the image embeddings change."""
    with torch.no_grad():
        for p in module.model.visual.merger.parameters():
            p.mul_(3.0)


def _engine(module) -> RolloutEngine:
    tok = tiny_vl_tokenizer()
    # one KV slot: prompt 1 is prefilled only once prompt 0 has finished, after the swap during its decode
    engine = RolloutEngine(module, rollout_cfg(free_cache_engine=False, max_num_seqs=1), eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, max_prompt_length=P, max_response_length=R)
    engine.check_every = 1
    return engine


def test_a_prompt_prefilled_after_new_weights_sees_images_encoded_by_them():
    old = _engine(_model()).generate(_prompts(), weight_check=lambda: 5)
    new_module = _model()
    _new_tower(new_module)
    new = _engine(new_module).generate(_prompts(), weight_check=lambda: 6)

    engine = _engine(_model())
    calls = []

    def swap() -> int:  # the first check after decoding began brings version 6, as the rollout worker installs it
        calls.append(1)
        if len(calls) == 2:
            _new_tower(engine.module)
            engine.sync_weights()
        return 5 if len(calls) < 2 else 6

    out = engine.generate(_prompts(), weight_check=swap)
    versions = out.batch["rollout_policy_version"]
    assert versions[0, 0] == 5 and bool((versions[1] == 6).all())  # prompt 0 began before the swap, 1 after
    logp = out.batch["rollout_log_probs"][1]
    torch.testing.assert_close(logp, new.batch["rollout_log_probs"][1], rtol=0, atol=1e-5)
    assert float((old.batch["rollout_log_probs"][1] - logp).abs().max()) > 1e-3  # the new tower mattered


def test_fsdp_actor_refuses_encoding_again():
    """Re-encoding at a prefill runs on one rank: the FSDP2-sharded actor (all ranks in each gather) refuses it."""
    from torch.distributed.fsdp import FSDPModule

    class Sharded(FSDPModule, torch.nn.Module):  # an FSDPModule to isinstance checks, without a process group
        pass

    module = _model()
    module.__class__ = type("FSDPQwen", (Sharded, type(module)), {})
    prompts = _prompts()
    with pytest.raises(ValueError, match="trainer.async.partial_rollout=continue"):
        vision.encode(module, prompts.batch["input_ids"], prompts.batch["attention_mask"],
                      list(prompts.non_tensor_batch["multi_modal_inputs"]), torch.float32, stamp=lambda: 0)
