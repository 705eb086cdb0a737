"""The `tiny-vl` preset: a random-init Qwen2.5-VL (2 layers, hidden 64, a 2-block vision tower) for tests and CPU runs.

Its tokenizer is the built-in character tokenizer plus Qwen2.5-VL's vision tokens (appended, so the text presets'
vocabularies and random inits stay as they were); its image processor is Qwen2-VL's with 4-pixel patches, 2x2
merging and images scaled to at most 32x32 pixels (at most 16 image tokens each). Nothing is downloaded.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from hybridflow.models.tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD, build_tokenizer_json

PRESET = "tiny-vl"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH, MERGE, MAX_SIDE = 4, 2, 32


@lru_cache(maxsize=1)
def tiny_vl_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in tokenizer with the vision tokens appended (cached; treat as read-only)."""
    tok_json = build_tokenizer_json()
    tok_json.add_special_tokens(VISION_TOKENS)
    tok = PreTrainedTokenizerFast(tokenizer_object=tok_json, pad_token=PAD, eos_token=EOS, bos_token=BOS,
                                  padding_side="left", clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_vl_image_processor() -> Qwen2VLImageProcessorPil:
    side = MAX_SIDE * MAX_SIDE
    return Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                    min_pixels=(PATCH * MERGE) ** 2, max_pixels=side)


def tiny_vl_config(**overrides: Any) -> Qwen2_5_VLConfig:
    """`overrides` go to the text model (e.g. num_hidden_layers=1), but `vision_config` (a dict) to the vision tower
    (benchmarks/vlm_step.py builds Qwen2.5-VL-3B's shape this way)."""
    vision_overrides = dict(overrides.pop("vision_config", None) or {})
    tok = tiny_vl_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    special = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    text = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
                rope_theta=10000.0, tie_word_embeddings=False, **special) | overrides
    # rotary frequencies split t/h/w as Qwen2.5-VL's 16/24/24 of 64: a quarter, then halves of the rest
    half = text["hidden_size"] // text["num_attention_heads"] // 2
    t = half // 4
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [t, (half - t) // 2, half - t - (half - t) // 2]}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=2, out_hidden_size=text["hidden_size"],
                  window_size=4 * PATCH * MERGE, fullatt_block_indexes=[1], in_channels=3) | vision_overrides
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                            video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                            vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False, **special)
