"""The `tiny-vl` preset: a Qwen2.5-VL built from the preset (no download), exported as an HF directory and loaded
back from it as `model.path` (weights, tokenizer and image processor)."""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from hybridflow.config import load_config
from hybridflow.data.vision import IMAGE_GRID_THW, PIXEL_VALUES
from hybridflow.engine.checkpoint import write_hf
from hybridflow.models.loader import load_image_processor, load_module, load_tokenizer, model_config


def test_exported_tiny_vl_loads_back_as_model_path(tmp_path):
    cfg = load_config([], ["model.preset=tiny-vl"]).model
    model = load_module(cfg).eval()
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    out, kind = write_hf(model.state_dict(), cfg, tmp_path / "hf", tokenizer=load_tokenizer(cfg))
    assert kind == "full"
    again_cfg = load_config([], [f"model.path={out}"]).model
    again = load_module(again_cfg).eval()
    proc = load_image_processor(again_cfg)
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(buf, "PNG")
    mm = proc(images=[Image.open(buf).convert("RGB")], return_tensors="pt")
    tok = load_tokenizer(again_cfg)
    ids = torch.tensor([[tok.convert_tokens_to_ids("<|vision_start|>")] + [model.config.image_token_id] * 16
                        + [tok.convert_tokens_to_ids("<|vision_end|>")] + tok.encode("How many?")])
    kw = dict(input_ids=ids, pixel_values=mm[PIXEL_VALUES], image_grid_thw=mm[IMAGE_GRID_THW],
              mm_token_type_ids=(ids == model.config.image_token_id).int())
    with torch.no_grad():
        torch.testing.assert_close(again(**kw).logits, model(**kw).logits)
    # a recipe's text-model overrides (as the preset takes them) still apply when it loads the exported directory
    shaped = load_config([], [f"model.path={out}", "model.override_config={rms_norm_eps: 1.0e-5}"]).model
    hf = model_config(shaped)
    assert hf.get_text_config().rms_norm_eps == 1.0e-5 and not hasattr(hf, "rms_norm_eps")
