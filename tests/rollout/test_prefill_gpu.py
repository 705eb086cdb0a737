"""Prefill on CUDA: the compiled pieces and the ungrouped-K/V (`enable_gqa`) SDPA give the logits that the eager
pieces with repeated K/V give, with and without left padding (the unpadded batch takes the mask-free causal path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rollout_helpers import EOS, PAD, make_model, make_prompts, rollout_cfg

from hybridflow.rollout import RolloutEngine, forward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("padded", [True, False])
def test_compiled_gqa_prefill_equals_eager_repeated_kv(padded, monkeypatch):
    model = make_model("qwen").to("cuda", torch.bfloat16)  # GQA: 8 query heads, 2 K/V heads
    engine = RolloutEngine(model, rollout_cfg(free_cache_engine=False), eos_token_id=EOS, pad_token_id=PAD,
                           max_prompt_length=16, max_response_length=4, dtype=torch.bfloat16, compile_decode=True)
    p = make_prompts(6, 16, model.config.vocab_size, seed=3)
    engine.generate(p)  # builds the runner
    r = engine._runner
    assert r.prefill_ops is forward.compiled_prefill_ops()
    ids, mask, pos = (p.batch[k].cuda() for k in ("input_ids", "attention_mask", "position_ids"))
    if not padded:
        mask = torch.ones_like(mask)
        pos = torch.arange(16, device="cuda").expand(6, 16).contiguous()
    none = torch.zeros(0, dtype=torch.long, device="cuda")

    def prefill(ops) -> torch.Tensor:
        with torch.no_grad():
            return forward.prefill(r.weights, r.spec, r.rope, ids, mask, pos, r.cache, none, none, ops).float()

    # a fall back to SDPA's math path (GQA with a mask) fails here instead of running slowly
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
        fast_eager, fast_compiled = prefill(forward.EAGER_OPS), prefill(forward.compiled_prefill_ops())
    sdpa = F.scaled_dot_product_attention

    def repeated_kv(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, scale=None):  # the path off CUDA
        g = q.shape[1] // k.shape[1]
        return sdpa(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), attn_mask=attn_mask,
                    is_causal=is_causal, scale=scale)

    monkeypatch.setattr(forward.F, "scaled_dot_product_attention", repeated_kv)
    ref = prefill(forward.EAGER_OPS)
    monkeypatch.undo()
    scale = ref.abs().max().item()
    for got in (fast_eager, fast_compiled):
        assert (got - ref).abs().max().item() < 0.05 * scale
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 5 / 6
    assert forward.compiled_prefill_ops().qkv.ok and forward.compiled_prefill_ops().mlp_block.ok
