"""Vision-language (tiny-vl, Qwen2.5-VL-shaped) generation and training forward with images, against HF's own
forward/generate run one prompt at a time without padding: the rollout (our engine, and the HF generate fallback)
and the trainer must give every row its own images and the same 3-D rope positions, whatever the padding and
micro-batching; a text-only row rides in the same batch."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image

from hybridflow.config import load_config
from hybridflow.data import collate_rl
from hybridflow.data.rl_dataset import RLHFDataset
from hybridflow.data.vision import IMAGE_GRID_THW, PIXEL_VALUES
from hybridflow.engine import HeadRequest, TrainEngine
from hybridflow.models.tiny_vl import tiny_vl_image_processor, tiny_vl_tokenizer
from hybridflow.protocol import keys
from hybridflow.rollout import RolloutEngine, forward, vision
from hybridflow.rollout.vision import suppressed_ids
from hybridflow.workers.engine_specs import actor_spec

P, R = 64, 5


def _png(w: int, h: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return {"bytes": buf.getvalue()}


def _prompts():
    """Three rows: images of different sizes (different image-token counts), one row with two images."""
    rows = [
        {"prompt": "<image>How many red?", "images": [_png(32, 32, 0)]},
        {"prompt": "Look: <image> then <image>.", "images": [_png(16, 24, 1), _png(24, 16, 2)]},
        {"prompt": "<image>?", "images": [_png(32, 16, 3)]},
        {"prompt": "No image here, just text."},
    ]
    rows = [r | {"reward_model": {"ground_truth": "1"}} for r in rows]
    ds = RLHFDataset(rows, tiny_vl_tokenizer(), max_prompt_length=P, image_processor=tiny_vl_image_processor())
    return collate_rl([ds[i] for i in range(len(ds))], pad_token_id=tiny_vl_tokenizer().pad_token_id)


@pytest.fixture(scope="module", params=["hybrid", "hf"])
def engines(gloo, request):
    cfg = load_config([], ["model.preset=tiny-vl", "actor.ppo_micro_batch_size_per_gpu=2",
                           "actor.log_prob_micro_batch_size_per_gpu=2", f"data.max_prompt_length={P}",
                           f"data.max_response_length={R}", f"rollout.name={request.param}"])
    engine = TrainEngine(actor_spec(cfg), device="cpu")
    tok = tiny_vl_tokenizer()
    rollout = RolloutEngine(engine.module, dataclasses.replace(cfg.rollout, free_cache_engine=False),
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, max_prompt_length=P,
                            max_response_length=R)
    assert rollout.uses_hf_fallback == (request.param == "hf")
    return engine, rollout


def _vision_kwargs(module, ids: torch.Tensor, mm: dict) -> dict:
    """HF's image arguments for one row (none for a text-only row)."""
    if not mm:
        return {}
    return dict(pixel_values=mm[PIXEL_VALUES], image_grid_thw=mm[IMAGE_GRID_THW],
                mm_token_type_ids=(ids == module.config.image_token_id).int())


def _hf_logits(module, prompt: torch.Tensor, response: torch.Tensor, mm: dict) -> torch.Tensor:
    """HF's forward on one unpadded row: logits predicting each response token [R', V]."""
    ids = torch.cat([prompt, response])[None]
    with torch.no_grad():
        out = module(input_ids=ids, **_vision_kwargs(module, ids, mm))
    return out.logits[0, len(prompt) - 1: -1].float()


def _rows(out, i):
    width = out.batch[keys.PROMPTS].shape[1]
    prompt = out.batch[keys.PROMPTS][i][out.batch[keys.ATTENTION_MASK][i, :width].bool()]
    n = int(out.batch[keys.RESPONSE_MASK][i].sum())
    return prompt, out.batch[keys.RESPONSES][i][:n], out.non_tensor_batch[keys.MULTI_MODAL_INPUTS][i]


def test_greedy_decode_equals_hf_generate_one_prompt_at_a_time(engines):
    engine, rollout = engines
    prompts = _prompts()
    prompts.meta_info = {"do_sample": False}
    out = rollout.generate(prompts)
    for i in range(len(prompts)):
        prompt, response, mm = _rows(out, i)
        ids = prompt[None]
        engine.module.unshard()  # FSDP2: HF generate runs the vision tower before the root's forward
        ref = engine.module.generate(input_ids=ids, **_vision_kwargs(engine.module, ids, mm), max_new_tokens=R,
                                     do_sample=False, suppress_tokens=suppressed_ids(engine.module.config),
                                     eos_token_id=rollout.eos_ids, pad_token_id=rollout.pad_id)
        engine.module.reshard()
        assert len(response) > 1 and response.tolist() == ref[0, len(prompt):len(prompt) + R].tolist(), f"row {i}"


def test_rollout_and_trainer_log_probs_equal_hf_forward_per_row(engines):
    engine, rollout = engines
    prompts = _prompts()
    prompts.meta_info = {"n": 2, "temperature": 0.8, "seeds": [1, 2, 3, 4]}
    out = rollout.generate(prompts)  # 8 rows; the trainer's micro-batches of 2 mix image sizes
    trainer = engine.infer(out, HeadRequest("lm", temperature=0.8))["log_probs"]
    suppressed = suppressed_ids(engine.module.config)
    for i in range(len(out)):
        prompt, response, mm = _rows(out, i)
        z = _hf_logits(engine.module, prompt, response, mm) / 0.8
        full = z.log_softmax(-1).gather(-1, response[:, None]).squeeze(-1)
        z[:, suppressed] = -torch.inf  # the sampler never draws vision tokens: its distribution is renormalised
        sampler = z.log_softmax(-1).gather(-1, response[:, None]).squeeze(-1)
        n = len(response)
        torch.testing.assert_close(trainer[i, :n], full, atol=1e-4, rtol=0, msg=f"trainer, row {i}")
        torch.testing.assert_close(out.batch[keys.ROLLOUT_LOG_PROBS][i, :n], sampler, atol=1e-4, rtol=0,
                                   msg=f"rollout, row {i}")


def test_native_prefill_logits_with_images_equal_hf_forward(engines):
    """The vision tower's embeddings at the image pads and the 3-D positions in our batched, left-padded prefill:
    the last prompt position's logits of each row equal HF's forward of that row alone."""
    engine, rollout = engines
    if rollout.uses_hf_fallback:
        pytest.skip("our engine's prefill")
    prompts = _prompts()
    b = prompts.batch
    ids, mask = b[keys.INPUT_IDS], b[keys.ATTENTION_MASK]
    rows = prompts.non_tensor_batch[keys.MULTI_MODAL_INPUTS]
    r = rollout._prepare()
    images = vision.encode(engine.module, ids, mask, rows, rollout.dtype)
    assert images.embeds[3] is None and images.pos_BP3.shape == (*ids.shape, 3)
    B = ids.shape[0]
    x = forward.scaled(r.eager_ops.embed(ids, r.weights.embed), r.spec.embed_scale)
    with torch.no_grad():
        logits = forward.prefill(r.weights, r.spec, r.rope, ids, mask, images.pos_BP3, r.cache,
                                 torch.arange(B), torch.arange(B),
                                 embeds_BPH=vision.input_embeds(x, ids, images.take(range(B)), images.image_token_id))
    for i in range(B):
        prompt = ids[i][mask[i].bool()]
        with torch.no_grad():
            ref = engine.module(input_ids=prompt[None], **_vision_kwargs(engine.module, prompt[None], rows[i]))
        torch.testing.assert_close(logits[i], ref.logits[0, -1], atol=1e-4, rtol=0, msg=f"row {i}")


def test_vision_language_refuses_what_the_engine_does_not_cover(engines):
    engine, rollout = engines
    if rollout.uses_hf_fallback:
        pytest.skip("our engine's options")
    with pytest.raises(ValueError, match="exact_logprobs=true with a vision-language model"):
        RolloutEngine(engine.module, rollout.cfg, eos_token_id=rollout.eos_ids, pad_token_id=rollout.pad_id,
                      max_prompt_length=P, max_response_length=R, exact_logprobs=True)
