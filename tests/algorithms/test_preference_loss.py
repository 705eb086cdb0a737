"""DPO / cDPO / IPO / SimPO against the papers' formulas, written here per pair in plain Python floats (math.log,
math.exp) on fixed random inputs — independent of the torch code path; plus the engine closure on interleaved,
padded pair rows against a naive per-row sum."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hybridflow.algorithms.preference import PairLogps, dpo, ipo, preference_loss, simpo
from hybridflow.protocol import DataProto
from hybridflow.workers.supervised_losses import PairPreferenceLoss


def _log_sigmoid(z: float) -> float:
    return -math.log1p(math.exp(-z))


def _inputs(n: int = 7, seed: int = 0) -> dict[str, list[float]]:
    rng = random.Random(seed)
    return {"pc": [rng.uniform(-30, -1) for _ in range(n)], "pr": [rng.uniform(-30, -1) for _ in range(n)],
            "rc": [rng.uniform(-30, -1) for _ in range(n)], "rr": [rng.uniform(-30, -1) for _ in range(n)],
            "lc": [float(rng.randint(1, 12)) for _ in range(n)], "lr": [float(rng.randint(1, 12)) for _ in range(n)]}


def _pairs(v: dict[str, list[float]]) -> PairLogps:
    t = {k: torch.tensor(x, dtype=torch.float64) for k, x in v.items()}
    return PairLogps(t["pc"], t["pr"], t["rc"], t["rr"], t["lc"], t["lr"])


@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (0.5, 0.0), (0.1, 0.2)])
def test_dpo_and_cdpo_match_the_paper(beta: float, eps: float) -> None:
    v = _inputs()
    out = dpo(_pairs(v), beta, eps)
    for i in range(len(v["pc"])):
        # Rafailov et al. eq. 7: -log σ(β log π(yw)/πref(yw) - β log π(yl)/πref(yl)); cDPO: ε-mixed with the flip.
        z = beta * (v["pc"][i] - v["rc"][i]) - beta * (v["pr"][i] - v["rr"][i])
        expected = -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z)
        assert float(out.loss_P[i]) == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert float(out.chosen_reward_P[i]) == pytest.approx(beta * (v["pc"][i] - v["rc"][i]), rel=1e-12)
        assert float(out.rejected_reward_P[i]) == pytest.approx(beta * (v["pr"][i] - v["rr"][i]), rel=1e-12)


def test_dpo_gradient_is_the_papers_weighting() -> None:
    """∂L/∂log π(yw) = -β σ(-z) (the paper's σ(r̂(yl) - r̂(yw)) weight), and +β σ(-z) for yl."""
    v = _inputs(3, seed=1)
    x = _pairs(v)
    pc, pr = x.chosen_P.clone().requires_grad_(), x.rejected_P.clone().requires_grad_()
    dpo(PairLogps(pc, pr, x.ref_chosen_P, x.ref_rejected_P), 0.3).loss_P.sum().backward()
    for i in range(3):
        z = 0.3 * ((v["pc"][i] - v["rc"][i]) - (v["pr"][i] - v["rr"][i]))
        w = 1 / (1 + math.exp(z))
        assert float(pc.grad[i]) == pytest.approx(-0.3 * w, rel=1e-10)
        assert float(pr.grad[i]) == pytest.approx(0.3 * w, rel=1e-10)


@pytest.mark.parametrize("tau", [0.1, 1.0])
def test_ipo_matches_the_paper(tau: float) -> None:
    v = _inputs(seed=2)
    out = ipo(_pairs(v), tau)
    for i in range(len(v["pc"])):
        # Azar et al. eq. 17: (h(yw, yl) - 1/(2τ))², h = log[π(yw) πref(yl) / (π(yl) πref(yw))].
        h = (v["pc"][i] + v["rr"][i]) - (v["pr"][i] + v["rc"][i])
        assert float(out.loss_P[i]) == pytest.approx((h - 1 / (2 * tau)) ** 2, rel=1e-12)
    # the minimum sits at h = 1/(2τ), not at infinity (IPO's point)
    at_target = PairLogps(torch.tensor([1 / (2 * tau)], dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                          torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    assert float(ipo(at_target, tau).loss_P[0]) == 0.0


@pytest.mark.parametrize("beta,gamma,eps", [(2.0, 0.5, 0.0), (10.0, 1.6, 0.0), (2.5, 0.3, 0.1)])
def test_simpo_matches_the_paper_and_ignores_the_reference(beta: float, gamma: float, eps: float) -> None:
    v = _inputs(seed=3)
    x = _pairs(v)
    out = simpo(x, beta, gamma, eps)
    for i in range(len(v["pc"])):
        # Meng et al. eq. 6: -log σ(β/|yw| log π(yw) - β/|yl| log π(yl) - γ).
        z = beta / v["lc"][i] * v["pc"][i] - beta / v["lr"][i] * v["pr"][i] - gamma
        expected = -(1 - eps) * _log_sigmoid(z) - eps * _log_sigmoid(-z)
        assert float(out.loss_P[i]) == pytest.approx(expected, rel=1e-12, abs=1e-12)
    no_ref = PairLogps(x.chosen_P, x.rejected_P, None, None, x.chosen_len_P, x.rejected_len_P)
    assert torch.equal(simpo(no_ref, beta, gamma, eps).loss_P, out.loss_P)


def test_dispatch_and_errors() -> None:
    x = _pairs(_inputs())
    assert torch.equal(preference_loss(x, "ipo", 0.2).loss_P, ipo(x, 0.2).loss_P)
    with pytest.raises(ValueError, match="dpo.loss_type='kto'"):
        preference_loss(x, "kto", 0.1)
    with pytest.raises(ValueError, match="reference log-probs"):
        dpo(PairLogps(x.chosen_P, x.rejected_P), 0.1)


@pytest.mark.parametrize("loss_type", ["dpo", "ipo", "simpo"])
def test_engine_closure_sums_masked_tokens_and_uses_the_global_pair_count(loss_type: str) -> None:
    torch.manual_seed(0)
    B, R = 6, 5
    logp = -torch.rand(B, R, dtype=torch.float64) * 3
    ref = -torch.rand(B, R, dtype=torch.float64) * 3
    mask = torch.ones(B, R, dtype=torch.long)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    logp[mask == 0] = 100.0  # padding must not count
    mb = DataProto.from_dict({"response_mask": mask, "pair_chosen": torch.tensor([1, 0] * 3), "ref_log_prob": ref})
    kwargs = {"loss_type": loss_type, "beta": 0.5, "label_smoothing": 0.0, "gamma": 0.4}
    # the whole mini-batch holds 5 pairs over all ranks (this micro-batch 3 of them)
    loss, metrics = PairPreferenceLoss(**kwargs)({"log_probs": logp}, mb,
                                                   {"seq-mean-token-mean": torch.tensor(10.0)})
    rows = [(sum(float(logp[b, t]) for t in range(R) if mask[b, t]), sum(float(ref[b, t]) for t in range(R) if mask[b, t]),
             float(mask[b].sum())) for b in range(B)]
    naive = 0.0
    for i in range(3):
        (pc, rc, lc), (pr, rr, lr) = rows[2 * i], rows[2 * i + 1]
        if loss_type == "dpo":
            naive += -_log_sigmoid(0.5 * ((pc - rc) - (pr - rr)))
        elif loss_type == "ipo":
            naive += ((pc - rc) - (pr - rr) - 1 / (2 * 0.5)) ** 2
        else:
            naive += -_log_sigmoid(0.5 * pc / lc - 0.5 * pr / lr - 0.4)
    assert float(loss) == pytest.approx(naive / 5, rel=1e-10)
    assert float(metrics["logps/chosen"]) == pytest.approx(sum(rows[2 * i][0] for i in range(3)) / 3, rel=1e-10)
    assert set(metrics) == {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
                            "logps/chosen", "logps/rejected"}
