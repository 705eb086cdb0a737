"""The tensor-parallel slicing rule: slices of all ranks tile every split weight; KV heads replicate when fewer."""

import pytest
import torch

from hybridflow.rollout.tp_layout import TPLayout, check_divisible, local_spec, param_slice, take
from hybridflow.rollout.weights import ArchSpec

SPEC = ArchSpec(num_layers=1, hidden=16, num_heads=4, num_kv_heads=2, head_dim=4, vocab=37, eps=1e-6)
SHAPES = {"model.embed_tokens.weight": (37, 16), "lm_head.weight": (37, 16),
          "model.layers.0.self_attn.q_proj.weight": (16, 16), "model.layers.0.self_attn.q_proj.bias": (16,),
          "model.layers.0.self_attn.k_proj.weight": (8, 16), "model.layers.0.self_attn.v_proj.weight": (8, 16),
          "model.layers.0.self_attn.o_proj.weight": (16, 16), "model.layers.0.mlp.gate_proj.weight": (24, 16),
          "model.layers.0.mlp.up_proj.weight": (24, 16), "model.layers.0.mlp.down_proj.weight": (16, 24),
          "model.layers.0.input_layernorm.weight": (16,), "model.norm.weight": (16,)}


@pytest.mark.parametrize("tp", [1, 2])
def test_slices_of_all_ranks_rebuild_every_weight(tp):
    for name, shape in SHAPES.items():
        full = torch.randn(shape)
        parts = [take(full, param_slice(name, shape, SPEC, TPLayout(tp, r))) for r in range(tp)]
        sl = param_slice(name, shape, SPEC, TPLayout(tp, 0))
        if sl is None:
            assert all(torch.equal(p, full) for p in parts), name
            continue
        joined = torch.cat(parts, dim=sl.dim).narrow(sl.dim, 0, full.shape[sl.dim])
        assert torch.equal(joined, full), name


def test_fewer_kv_heads_than_ranks_replicate_the_head_the_queries_use():
    tp = 4  # 4 query heads, 2 KV heads (group 2): ranks 0,1 use KV head 0; ranks 2,3 KV head 1
    full = torch.arange(8 * 16, dtype=torch.float32).view(8, 16)
    for r in range(tp):
        sl = param_slice("model.layers.0.self_attn.k_proj.weight", (8, 16), SPEC, TPLayout(tp, r))
        assert (sl.start, sl.stop) == ((r // 2) * 4, (r // 2) * 4 + 4)
        q = param_slice("model.layers.0.self_attn.q_proj.weight", (16, 16), SPEC, TPLayout(tp, r))
        assert q.start // SPEC.head_dim // 2 == sl.start // SPEC.head_dim  # the rank's query head's KV head
        assert take(full, sl).shape == (4, 16)
    assert local_spec(SPEC, TPLayout(tp, 3)).num_kv_heads == 1


def test_vocab_shard_is_padded_and_shape_errors_name_the_key():
    last = take(torch.ones(37, 16), param_slice("lm_head.weight", (37, 16), SPEC, TPLayout(2, 1)))
    assert last.shape == (19, 16) and last[18].abs().sum() == 0 and last[17].sum() == 16
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3"):
        check_divisible(SPEC, 24, 3)
