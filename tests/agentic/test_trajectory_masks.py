"""Tool and user tokens of a multi-turn trajectory carry no loss, KL or entropy: whatever sits at the positions
`response_mask` leaves out (log-probs, reference, advantages, entropy), the actor loss and its gradient ignore it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.protocol import DataProto
from hybridflow.workers.losses import make_actor_loss

# two trajectories: assistant turn, appended tool/user tokens, assistant turn, padding
MASK = torch.tensor([[1, 1, 0, 0, 0, 1, 1, 0], [1, 0, 0, 1, 1, 1, 0, 0]])


def _batch(noise_on_context: float):
    shape = MASK.shape
    junk = (1 - MASK) * noise_on_context  # only the context/padding positions differ between calls
    logp = (-torch.rand(shape, generator=torch.Generator().manual_seed(0)) - 0.1 + junk).requires_grad_(True)
    mb = DataProto.from_dict({
        "response_mask": MASK,
        "old_log_probs": -torch.rand(shape, generator=torch.Generator().manual_seed(1)) - 0.1 - 3 * junk,
        "ref_log_prob": -torch.rand(shape, generator=torch.Generator().manual_seed(2)) - 0.1 + 5 * junk,
        "advantages": torch.randn(shape, generator=torch.Generator().manual_seed(3)) + 7 * junk,
    })
    entropy = torch.rand(shape, generator=torch.Generator().manual_seed(4)) + 2 * junk
    return {"log_probs": logp, "entropy": entropy}, mb


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_context_tokens_have_no_loss_kl_or_entropy(agg):
    cfg = dataclasses.replace(load_config().actor, loss_agg_mode=agg, entropy_coeff=0.01, kl_loss_coef=0.1)
    loss_fn = make_actor_loss(cfg, MASK.shape[1], use_kl_loss=True)
    results = []
    for noise in (0.0, 4.0):
        outputs, mb = _batch(noise)
        loss, metrics = loss_fn(outputs, mb, None)
        loss.backward()
        results.append((loss.detach(), {k: float(v) for k, v in metrics.items()}, outputs["log_probs"].grad))
    (l0, m0, g0), (l1, m1, g1) = results
    torch.testing.assert_close(l0, l1)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        assert m0[key] == pytest.approx(m1[key]), key
    assert (g0[MASK == 0] == 0).all() and (g1[MASK == 0] == 0).all()  # no gradient reaches context tokens
    assert (g0[MASK == 1] != 0).any()
    torch.testing.assert_close(g0, g1)
