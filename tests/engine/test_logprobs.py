import pytest
import torch

from hybridflow.algorithms.masked import entropy_from_logits
from hybridflow.engine.logprobs import chunked_logprobs


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_logprobs_match_full_softmax(chunk):
    torch.manual_seed(0)
    h = torch.randn(10, 8, requires_grad=True)
    head = torch.nn.Linear(8, 37, bias=False)
    y = torch.randint(0, 37, (10,))
    lp, ent = chunked_logprobs(h, head, y, temperature=0.7, chunk_size=chunk, with_entropy=True)
    logits = head(h) / 0.7
    ref_lp = torch.log_softmax(logits, -1).gather(-1, y[:, None]).squeeze(-1)
    ref_ent = entropy_from_logits(logits)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)
    g = torch.autograd.grad((lp.sum() + 0.1 * ent.sum()), [h, head.weight])
    g_ref = torch.autograd.grad((ref_lp.sum() + 0.1 * ref_ent.sum()), [h, head.weight])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bad_arguments_raise():
    head = torch.nn.Linear(4, 5)
    with pytest.raises(ValueError, match="temperature"):
        chunked_logprobs(torch.zeros(2, 4), head, torch.zeros(2, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match="logprob_chunk_size"):
        chunked_logprobs(torch.zeros(2, 4), head, torch.zeros(2, dtype=torch.long), chunk_size=0)


def test_peak_memory_is_one_chunk_not_tokens_times_vocab():
    """Saved activations for backward hold no [K, V] tensor: only inputs are saved per chunk (recomputed)."""
    h = torch.randn(512, 16, requires_grad=True)
    head = torch.nn.Linear(16, 1000, bias=False)
    y = torch.randint(0, 1000, (512,))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, _ = chunked_logprobs(h, head, y, chunk_size=64)
    assert lp.shape == (512,)
    assert max(saved) < 64 * 1000, f"a saved tensor has {max(saved)} elements (>= one chunk of logits)"
