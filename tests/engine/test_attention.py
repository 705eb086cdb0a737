"""The varlen-attention adapter (GPU kernel) checked on CPU against SDPA with fake kernels of both torch APIs."""

import pytest
import torch
import torch.nn.functional as F

from hybridflow.engine import attention


def _reference_kernel(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """[T, H, D] varlen attention by per-sequence SDPA (what the flash kernel computes)."""
    out = []
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1),
                                           is_causal=causal, scale=scale)
        out.append(o.transpose(0, 1))
    return torch.cat(out)


def fake_old_api(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    assert query.shape[1] == key.shape[1], "old API has no GQA"
    return _reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, None)


def fake_new_api(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    assert window_size in ((-1, -1), (-1, 0))
    if enable_gqa:
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    return _reference_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0), scale)


@pytest.mark.parametrize("fake", [fake_old_api, fake_new_api])
def test_varlen_adapter_matches_sdpa(monkeypatch, fake):
    import inspect

    monkeypatch.setattr(attention, "_varlen_attn", fake)
    monkeypatch.setattr(attention, "_VARLEN_PARAMS", set(inspect.signature(fake).parameters))
    monkeypatch.setattr(attention, "varlen_supported", lambda q: True)
    torch.manual_seed(0)
    lens = [3, 5, 1]
    T, Hq, Hkv, D = sum(lens), 4, 2, 8
    q, k, v = torch.randn(1, Hq, T, D), torch.randn(1, Hkv, T, D), torch.randn(1, Hkv, T, D)
    cu = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    out, _ = attention.packed_attention_forward(None, q, k, v, None, scaling=D ** -0.5,
                                                **{attention.CU_SEQLENS: cu, attention.MAX_SEQLEN: 5})
    ref = attention._padded_sdpa(q, k, v, cu, D ** -0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert out.shape == (1, T, Hq, D)


def test_varlen_failure_falls_back_to_sdpa(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(attention, "_varlen_attn", broken)
    monkeypatch.setattr(attention, "_varlen_error", None)
    monkeypatch.setattr(attention, "varlen_supported", lambda q: attention._varlen_error is None)
    q = k = v = torch.randn(1, 2, 4, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    out, _ = attention.packed_attention_forward(None, q, k, v, None, **{attention.CU_SEQLENS: cu,
                                                                         attention.MAX_SEQLEN: 4})
    torch.testing.assert_close(out, attention._padded_sdpa(q, k, v, cu, None))
    assert "no kernel image" in attention._varlen_error
