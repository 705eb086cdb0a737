"""agg_loss modes against naive loops, and split invariance with the global normaliser (micro-batches, DP)."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
from ranks_testlib import rank_context

from hybridflow.algorithms import (
    LOSS_AGG_MODES,
    agg_loss,
    compute_value_loss,
    global_loss_normalizer,
    gspo_policy_loss,
    loss_normalizer,
    vanilla_policy_loss,
)

SPLITS = [3, 5, 2, 6]  # 4 unequal micro-batches of a batch of 16


def ragged(seed, B=16, T=9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[:2] = torch.tensor([T, 0])  # a full row and an empty (padding) row
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return mask, g


def naive(loss, mask, mode, max_len):
    rows = [[x for x, m in zip(lr, mr) if m] for lr, mr in zip(loss.tolist(), mask.tolist())]
    seqs = [r for r in rows if r]
    if mode == "token-mean":
        return sum(map(sum, rows)) / sum(map(len, rows))
    if mode == "seq-mean-token-sum":
        return sum(map(sum, seqs)) / len(seqs)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in seqs) / len(seqs)
    return sum(sum(r) / max_len for r in seqs) / len(seqs)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_modes_match_naive(mode):
    mask, g = ragged(0)
    loss = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    assert agg_loss(loss, mask, mode, max_len=12).item() == pytest.approx(naive(loss, mask, mode, 12), abs=1e-12)


def test_normaliser_counts():
    mask, _ = ragged(1)
    assert loss_normalizer(mask, "token-mean").item() == mask.sum().item()
    nonempty = sum(1 for r in mask.tolist() if any(r))
    for mode in LOSS_AGG_MODES[1:]:
        assert loss_normalizer(mask, mode).item() == nonempty
    micro = list(mask.split(SPLITS))
    assert global_loss_normalizer(micro, "token-mean").item() == mask.sum().item()


def test_empty_micro_batch_is_zero_not_nan():
    z = torch.zeros(2, 3)
    for mode in LOSS_AGG_MODES:
        assert agg_loss(torch.randn(2, 3), z, mode).item() == 0.0


def test_bad_mode_lists_modes():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        agg_loss(torch.zeros(1, 1), torch.ones(1, 1), "token_mean")


def grads_whole_vs_micro(mode, loss_fn, seed):
    """Grad of the whole-batch loss vs the sum over 4 micro-batches using the global normaliser."""
    mask, g = ragged(seed)
    x = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    w_whole = torch.randn(mask.shape[1], generator=g, dtype=torch.float64).requires_grad_(True)
    w_micro = w_whole.detach().clone().requires_grad_(True)
    loss_fn(x, w_whole, mask, None).backward()
    n = global_loss_normalizer(list(mask.split(SPLITS)), mode)
    total = 0.0
    for xm, mm in zip(x.split(SPLITS), mask.split(SPLITS)):
        lm = loss_fn(xm, w_micro, mm, n)
        lm.backward()
        total += lm.item()
    return w_whole.grad, w_micro.grad, total


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_split_invariance_agg_loss(mode):
    def fn(x, w, m, n):
        return agg_loss((x * w).sin() ** 2, m, mode, global_normalizer=n, max_len=9)

    gw, gm, _ = grads_whole_vs_micro(mode, fn, seed=2)
    assert torch.allclose(gw, gm, atol=1e-6, rtol=0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_name", ["vanilla", "gspo", "value"])
def test_split_invariance_losses(mode, loss_name):
    def fn(x, w, m, n):
        logp = -(x * w).abs()
        old = logp.detach() + 0.3 * torch.cos(x)
        adv = torch.sin(3 * x)
        if loss_name == "vanilla":
            return vanilla_policy_loss(old, logp, adv, m, loss_agg_mode=mode, global_normalizer=n, max_len=9)[0]
        if loss_name == "gspo":
            return gspo_policy_loss(old, logp, adv, m, clip_ratio_low=0.1, clip_ratio_high=0.1,
                                    loss_agg_mode=mode, global_normalizer=n, max_len=9)[0]
        return compute_value_loss(x * w, adv, old, m, cliprange_value=0.2, loss_agg_mode=mode,
                                  global_normalizer=n, max_len=9)[0]

    gw, gm, _ = grads_whole_vs_micro(mode, fn, seed=3)
    assert torch.allclose(gw, gm, atol=1e-6, rtol=0)


def test_without_global_normaliser_splits_differ():
    """Guard that the invariance test can fail: local token-mean over ragged micro-batches is not the batch mean."""
    mask, g = ragged(4)
    x = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    whole = agg_loss(x, mask, "token-mean").item()
    micro = sum(agg_loss(xm, mm, "token-mean").item() for xm, mm in zip(x.split(SPLITS), mask.split(SPLITS))) / 4
    assert abs(whole - micro) > 1e-3


def _dp_worker(rank, world, port, mode, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mask, g = ragged(5)
        x = torch.randn(mask.shape, generator=g, dtype=torch.float64)
        w = torch.randn(mask.shape[1], generator=g, dtype=torch.float64).requires_grad_(True)
        # rank r holds micro-batches r and r+2 of the 4 splits
        xs, ms = x.split(SPLITS), mask.split(SPLITS)
        mine = [rank, rank + 2]
        n = global_loss_normalizer([ms[i] for i in mine], mode)
        for i in mine:
            agg_loss((xs[i] * w).sin() ** 2, ms[i], mode, global_normalizer=n, max_len=9).backward()
        dist.all_reduce(w.grad)  # sum over DP ranks (the engine's DP-size factor undoes FSDP's average)
        if rank == 0:
            q.put((w.grad.tolist(), n.item()))
    finally:
        dist.destroy_process_group()


def test_split_invariance_across_two_dp_ranks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = rank_context()
    q = ctx.Queue()
    mode = "seq-mean-token-mean"
    procs = [ctx.Process(target=_dp_worker, args=(r, 2, port, mode, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        grad, n = q.get(timeout=120)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
    finally:  # a hung rank must not outlive the test
        for p in procs:
            if p.is_alive():
                p.kill()
    mask, g = ragged(5)
    x = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    w = torch.randn(mask.shape[1], generator=g, dtype=torch.float64).requires_grad_(True)
    agg_loss((x * w).sin() ** 2, mask, mode).backward()
    assert n == loss_normalizer(mask, mode).item()
    assert torch.allclose(torch.tensor(grad, dtype=torch.float64), w.grad, atol=1e-6, rtol=0)
