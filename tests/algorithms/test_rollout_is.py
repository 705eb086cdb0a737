"""Off-policy correction (algorithm.rollout_is): TIS weights, the IS mask and their metrics on fixed tensors with
hand-computed values; the actor loss with the correction off is bit-identical to the loss without it."""

import math

import pytest
import torch

from hybridflow.algorithms import POLICY_LOSSES, rollout_is_metrics, rollout_is_weights, vanilla_policy_loss
from hybridflow.config import load_config
from hybridflow.config.schema import RolloutISConfig
from hybridflow.protocol import DataProto
from hybridflow.workers.losses import make_actor_loss

# ratios pi_old / pi_rollout per token: 1, 0.5, 3, 0.4 | 2, 0.25, (pad: 7)
RATIOS = torch.tensor([[1.0, 0.5, 3.0, 0.4], [2.0, 0.25, 7.0, 1.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.1, -1.5, -2.5, -0.7]])
OLD = ROLLOUT + RATIOS.log()


def test_tis_weight_is_ratio_truncated_at_cap_and_zero_on_pads() -> None:
    w = rollout_is_weights(OLD, ROLLOUT, MASK, mode="tis", cap=2.0)
    expected = torch.tensor([[1.0, 0.5, 2.0, 0.4], [2.0, 0.25, 0.0, 0.0]])
    torch.testing.assert_close(w, expected)


def test_mask_keeps_ratios_inside_the_band_inclusive() -> None:
    w = rollout_is_weights(OLD, ROLLOUT, MASK, mode="mask", cap=2.0)
    # band [0.5, 2]: 1 in, 0.5 in (edge), 3 out, 0.4 out | 2 in (edge), 0.25 out, pads 0
    expected = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert torch.equal(w, expected)


def test_weights_are_detached() -> None:
    old = OLD.clone().requires_grad_(True)
    assert not rollout_is_weights(old, ROLLOUT, MASK, mode="tis", cap=2.0).requires_grad


def test_metrics_over_valid_tokens() -> None:
    valid = [1.0, 0.5, 3.0, 0.4, 2.0, 0.25]
    m = rollout_is_metrics(OLD, ROLLOUT, MASK, mode="mask", cap=2.0)
    assert m["rollout_is/mean"] == pytest.approx(sum(valid) / 6)  # 7.15 / 6
    assert m["rollout_is/max"] == pytest.approx(3.0)  # the pad's 7 is not counted
    assert m["rollout_is/clip_frac"] == pytest.approx(1 / 6)  # only 3 > 2
    assert m["rollout_is/mask_frac"] == pytest.approx(3 / 6)  # 3, 0.4, 0.25 leave [0.5, 2]
    tis = rollout_is_metrics(OLD, ROLLOUT, MASK, mode="tis", cap=2.0)
    assert "rollout_is/mask_frac" not in tis and tis["rollout_is/clip_frac"] == pytest.approx(1 / 6)


def test_vanilla_loss_weighted_per_token_hand_computed() -> None:
    # on-policy (ratio 1, no PPO clipping): token loss -A; TIS weights it; token-mean over 6 valid tokens
    adv = torch.tensor([[1.0, -2.0, 0.5, 1.0], [-1.0, 4.0, 9.0, 9.0]])
    logp = torch.zeros(2, 4, requires_grad=True)
    w = rollout_is_weights(OLD, ROLLOUT, MASK, mode="tis", cap=2.0)
    loss, _ = vanilla_policy_loss(logp.detach(), logp, adv, MASK, rollout_is_weights=w)
    expected = -(1 * 1.0 + 0.5 * -2.0 + 2.0 * 0.5 + 0.4 * 1.0 + 2.0 * -1.0 + 0.25 * 4.0) / 6  # = -0.4 / 6
    assert loss.item() == pytest.approx(expected)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv * w / 6)  # the gradient is weighted, the weights are constants


def _actor_cfg():
    return load_config().actor


def _mb(rollout: torch.Tensor) -> tuple[dict[str, torch.Tensor], DataProto]:
    g = torch.Generator().manual_seed(0)
    log_prob = -torch.rand(2, 4, generator=g) - 0.1
    old = log_prob + 0.3 * torch.randn(2, 4, generator=g)
    mb = DataProto.from_dict({"response_mask": MASK, "old_log_probs": old, "rollout_log_probs": rollout,
                              "advantages": torch.randn(2, 4, generator=g)})
    return {"log_probs": log_prob}, mb


def test_mode_null_gives_the_bit_identical_loss() -> None:
    cfg = _actor_cfg()
    outputs, mb = _mb(ROLLOUT)
    today = make_actor_loss(cfg, 4, False)(outputs, mb, None)
    off = make_actor_loss(cfg, 4, False, rollout_is=RolloutISConfig(mode=None, cap=2.0))(outputs, mb, None)
    assert torch.equal(today[0], off[0])
    assert today[1].keys() == off[1].keys()
    direct, _ = POLICY_LOSSES[cfg.policy_loss](
        mb.batch["old_log_probs"], outputs["log_probs"], mb.batch["advantages"], MASK, clip_ratio_low=cfg.clip_ratio,
        clip_ratio_high=cfg.clip_ratio, clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode,
        global_normalizer=None, max_len=4)
    assert torch.equal(off[0], direct)


@pytest.mark.parametrize("mode", ["tis", "mask"])
def test_modes_change_the_loss_only_through_the_weights(mode: str) -> None:
    cfg = _actor_cfg()
    outputs, mb = _mb(ROLLOUT)
    on = make_actor_loss(cfg, 4, False, rollout_is=RolloutISConfig(mode=mode, cap=2.0))(outputs, mb, None)[0]
    off = make_actor_loss(cfg, 4, False)(outputs, mb, None)[0]
    assert math.isfinite(on.item()) and on.item() != off.item()
    # rollout log-probs equal to the trainer's: ratio 1 everywhere, weight exactly 1, the loss unchanged
    outputs, mb = _mb(ROLLOUT)
    mb.batch["rollout_log_probs"] = mb.batch["old_log_probs"].clone()
    same = make_actor_loss(cfg, 4, False, rollout_is=RolloutISConfig(mode=mode, cap=2.0))(outputs, mb, None)[0]
    assert torch.equal(same, make_actor_loss(cfg, 4, False)(outputs, mb, None)[0])


def test_loss_without_the_weights_parameter_is_refused() -> None:
    @POLICY_LOSSES.register("test_no_is", override=True)
    def no_is(old_log_prob, log_prob, advantages, response_mask, **_):
        return (-(advantages * log_prob)).mean(), {}

    cfg = load_config(overrides=["actor.policy_loss=test_no_is"]).actor
    with pytest.raises(ValueError, match=r"test_no_is.*rollout_is_weights.*algorithm.rollout_is.mode=null"):
        make_actor_loss(cfg, 4, False, rollout_is=RolloutISConfig(mode="tis", cap=2.0))
    make_actor_loss(cfg, 4, False, rollout_is=RolloutISConfig(mode=None, cap=2.0))  # off: fine


@pytest.mark.parametrize(("override", "match"), [
    ("algorithm.rollout_is.mode=truncate", r"algorithm\.rollout_is\.mode='truncate': must be tis, mask or null"),
    ("algorithm.rollout_is.cap=1.0", r"algorithm\.rollout_is\.cap=1\.0: must be > 1"),
])
def test_config_errors_name_the_key_and_the_fix(override: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_config(overrides=[override])


def test_defaults_off_and_on_forces_old_log_prob() -> None:
    from hybridflow.config import resolve

    cfg = load_config()
    assert cfg.algorithm.rollout_is.mode == "auto" and resolve(cfg).rollout_is is None  # auto without fp8: off
    on_policy = ["actor.ppo_epochs=1", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8"]
    assert not resolve(load_config(overrides=on_policy)).recompute_old_log_prob
    assert resolve(load_config(overrides=[*on_policy, "algorithm.rollout_is.mode=tis"])).recompute_old_log_prob


def test_the_loss_refuses_an_undecided_mode() -> None:
    with pytest.raises(ValueError, match=r"mode='auto' \(undecided\).*resolved.rollout_is\(cfg\)"):
        make_actor_loss(_actor_cfg(), 4, False, rollout_is=RolloutISConfig(mode="auto", cap=2.0))
