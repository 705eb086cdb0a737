import pytest
import torch

from hybridflow.algorithms.masked import entropy_from_logits
from hybridflow.engine.logprobs import chunked_logprobs, dlogits, logit_stats
from hybridflow.utils.compile import GuardedCompile


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


def _reference(h, weight, bias, y, temperature):
    """Naive full-softmax log-probs and entropy over the whole [K, V] logits."""
    logits = torch.nn.functional.linear(h, weight, bias) / temperature
    logp_all = torch.log_softmax(logits, -1)
    return logp_all.gather(-1, y[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def _inputs(K=10, H=6, V=23, bias=True):
    torch.manual_seed(K * 100 + V)
    h = torch.randn(K, H, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(H, V, bias=bias, dtype=torch.float64)
    return h, head, torch.randint(0, V, (K,))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_coef", [None, 0.0, 0.3])  # None: no entropy; 0.0: computed, not in the loss
@pytest.mark.parametrize("chunk", [3, 4, 64])  # 3 and 4 do not divide K=10
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_grads_match_naive_reference(temperature, entropy_coef, chunk, bias):
    h, head, y = _inputs(bias=bias)
    params = [h, head.weight] + ([head.bias] if bias else [])
    lp, ent = chunked_logprobs(h, head, y, temperature=temperature, chunk_size=chunk,
                               with_entropy=entropy_coef is not None)
    ref_lp, ref_ent = _reference(h, head.weight, head.bias, y, temperature)
    assert lp.dtype == torch.float32 and lp.shape == (10,)
    torch.testing.assert_close(lp, ref_lp.float(), atol=1e-5, rtol=1e-5)
    assert (ent is None) == (entropy_coef is None)
    w_lp = torch.linspace(-1, 2, 10, dtype=torch.float64)  # per-token loss weights, like advantages
    loss = (lp.double() * w_lp).sum()
    ref_loss = (ref_lp * w_lp).sum()
    if entropy_coef is not None:
        torch.testing.assert_close(ent, ref_ent.float(), atol=1e-5, rtol=1e-5)
        if entropy_coef:
            loss = loss + entropy_coef * (ent.double() * w_lp.flip(0)).sum()
            ref_loss = ref_loss + entropy_coef * (ref_ent * w_lp.flip(0)).sum()
    for got, want in zip(torch.autograd.grad(loss, params), torch.autograd.grad(ref_loss, params)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_grads_with_hidden_not_requiring_grad_and_entropy_only_loss():
    h, head, y = _inputs()
    h, weight = h.detach(), head.weight
    _, ent = chunked_logprobs(h, weight, y, temperature=0.9, chunk_size=4, with_entropy=True)
    _, ref_ent = _reference(h, weight, None, y, 0.9)
    (got,) = torch.autograd.grad(ent.sum(), [weight])
    (want,) = torch.autograd.grad(ref_ent.sum(), [weight])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_no_grad_path_gives_same_values_and_no_graph():
    h, head, y = _inputs()
    lp, ent = chunked_logprobs(h, head, y, temperature=0.7, chunk_size=3, with_entropy=True)
    with torch.no_grad():
        lp_ng, ent_ng = chunked_logprobs(h, head, y, temperature=0.7, chunk_size=3, with_entropy=True)
    assert lp_ng.grad_fn is None and ent_ng.grad_fn is None
    torch.testing.assert_close(lp_ng, lp.detach(), atol=0, rtol=0)
    torch.testing.assert_close(ent_ng, ent.detach(), atol=0, rtol=0)


def test_empty_input_keeps_graph_connected():
    weight = torch.randn(5, 4, requires_grad=True)
    lp, ent = chunked_logprobs(torch.zeros(0, 4), weight, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == (0,) and ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert weight.grad is not None and not weight.grad.any()


def test_fused_pieces_compile_on_cpu():
    """The code path CUDA takes: the fused pieces through torch.compile equal the eager ones."""
    pytest.importorskip("torch._inductor")
    torch.manual_seed(0)
    logits = torch.randn(5, 37)
    y = torch.randint(0, 37, (5,))
    dlogp, dent = torch.randn(5), torch.randn(5)
    stats_c, dlogits_c = GuardedCompile(logit_stats, "stats"), GuardedCompile(dlogits, "dlogits")
    lp, logz, ent = stats_c(logits, y, 0.7, True)
    assert stats_c.ok, "logit_stats failed to compile"
    ref = logit_stats(logits, y, 0.7, True)
    for got, want in zip((lp, logz, ent), ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got = dlogits_c(logits, y, logz, dlogp, 0.7, ent, dent)
    assert dlogits_c.ok, "dlogits failed to compile"
    torch.testing.assert_close(got, dlogits(logits, y, logz, dlogp, 0.7, ent, dent), atol=1e-5, rtol=1e-5)


