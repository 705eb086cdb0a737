"""Every loss the engine trains with is one `LossFn` (same call signature, typed), and the actor's policy loss is
resolved from `POLICY_LOSSES` once, into a typed field — a plugin's registered loss is the one the actor calls."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch

from hybridflow.algorithms import POLICY_LOSSES, vanilla_policy_loss
from hybridflow.config import load_config
from hybridflow.engine import LossFn
from hybridflow.protocol import DataProto
from hybridflow.workers.losses import ActorLoss, CriticLoss, make_actor_loss
from hybridflow.workers.supervised_losses import (
    SUPERVISED_LOSSES,
    BradleyTerryLoss,
    PairPreferenceLoss,
    SFTLoss,
)


@pytest.mark.parametrize("cls", [ActorLoss, CriticLoss, SFTLoss, BradleyTerryLoss, PairPreferenceLoss])
def test_every_loss_has_the_one_loss_fn_signature(cls):
    assert typing.get_type_hints(cls.__call__) == typing.get_type_hints(LossFn.__call__)
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen


def test_supervised_losses_are_built_by_name():
    assert SUPERVISED_LOSSES["preference"](loss_type="ipo", beta=0.3) == PairPreferenceLoss("ipo", 0.3)
    assert SUPERVISED_LOSSES["bradley_terry"](margin=0.5).margin == 0.5


def test_actor_loss_calls_the_resolved_policy_loss():
    calls = []

    def mine(old_log_prob, log_prob, advantages, response_mask, **kw):
        calls.append(kw["loss_agg_mode"])
        return vanilla_policy_loss(old_log_prob, log_prob, advantages, response_mask, **kw)

    POLICY_LOSSES.register("test_plugin_pg", override=True)(mine)
    cfg = dataclasses.replace(load_config().actor, policy_loss="test_plugin_pg")
    loss = make_actor_loss(cfg, 4, use_kl_loss=False)
    assert loss.policy_loss is mine
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(2, 4, generator=g)
    mb = DataProto.from_dict({"response_mask": torch.ones(2, 4, dtype=torch.long), "old_log_probs": logp - 0.1,
                              "advantages": torch.randn(2, 4, generator=g)})
    value, metrics = loss({"log_probs": logp}, mb, None)
    ref, _ = make_actor_loss(load_config().actor, 4, use_kl_loss=False)({"log_probs": logp}, mb, None)
    assert calls == [cfg.loss_agg_mode] and torch.equal(value, ref) and "actor/pg_clipfrac" in metrics
    with pytest.raises(KeyError, match="vanilla"):
        make_actor_loss(dataclasses.replace(cfg, policy_loss="nope"), 4, use_kl_loss=False)
