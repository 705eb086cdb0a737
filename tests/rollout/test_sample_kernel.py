"""The fused Triton sampler vs the torch sampler (`sampling.sample`): same tokens (bit-identical counter noise),
same log-probs, first-index tie breaking, and the `filtered` mode handed to torch.

Runs the kernel in-process on a GPU; without one, `test_kernel_under_interpreter` reruns this file in a subprocess
with TRITON_INTERPRET=1 (triton fixes its mode when first imported, which torch >= 2.13 does with torch itself).
"""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import rerun_under_triton_interpreter

pytest.importorskip("triton")
from hybridflow.rollout import sample_kernel as sk  # noqa: E402
from hybridflow.rollout import triton_util  # noqa: E402
from hybridflow.rollout.sampling import row_seed, sample  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
needs_kernel = pytest.mark.skipif(not (CUDA or triton_util.INTERPRETED),
                                  reason="covered by test_kernel_under_interpreter (subprocess)")


def _args(N, V, temp=0.7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=g) * 3).to(DEV)
    seeds = torch.tensor([row_seed(seed, i) for i in range(N)], device=DEV)
    steps = torch.arange(N, device=DEV) % 7
    t = torch.tensor(temp, device=DEV)
    return logits, t, torch.tensor(V, device=DEV), torch.tensor(1.0, device=DEV), seeds, steps


@needs_kernel
@pytest.mark.parametrize("mode", ["sample", "greedy"])
@pytest.mark.parametrize("V", [50, 3000, 5000])  # below, across and not a multiple of BLOCK_V
def test_kernel_matches_torch_sampler(mode, V):
    logits, *rest = _args(16, V)
    logits[3, 17] = float("-inf")  # a masked token is never drawn and does not break the logsumexp
    tok, logp = sk.fused_sample(logits, mode, *rest)
    ref_tok, ref_logp = sample(logits, mode, *rest)
    assert torch.equal(tok, ref_tok)
    torch.testing.assert_close(logp, ref_logp, atol=1e-5, rtol=0)


@needs_kernel
def test_greedy_ties_take_the_first_index_and_strided_rows_work():
    logits = torch.zeros(3, 4200, device=DEV)
    logits[0, [5, 2100, 4100]] = 2.0  # tie across chunks and lanes
    logits[1, [4099, 4098]] = 1.0
    wide = torch.zeros(3, 5000, device=DEV)
    wide[:, :4200] = logits
    _, t, k, p, seeds, steps = _args(3, 4200)
    tok, _ = sk.fused_sample(wide[:, :4200], "greedy", t, k, p, seeds, steps)  # non-contiguous rows
    assert tok.tolist() == [5, 4098, 0]


def test_filtered_mode_uses_torch():
    logits, t, _, _, seeds, steps = _args(8, 40)
    k, p = torch.tensor(5, device=DEV), torch.tensor(0.9, device=DEV)
    tok, logp = sk.fused_sample(logits, "filtered", t, k, p, seeds, steps)
    ref_tok, ref_logp = sample(logits, "filtered", t, k, p, seeds, steps)
    assert torch.equal(tok, ref_tok) and torch.equal(logp, ref_logp)


@pytest.mark.skipif(CUDA or triton_util.INTERPRETED, reason="the kernel runs in this process")
def test_kernel_under_interpreter():
    rerun_under_triton_interpreter(__file__)
