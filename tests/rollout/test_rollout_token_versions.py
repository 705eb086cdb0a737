"""Partial rollouts (trainer.async.partial_rollout=continue) in the engine: new weights taken between decode chunks,
every token labelled with the policy version that sampled it (rollout/versions.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from rollout_helpers import make_engine, make_model, make_prompts

B, N, P, R = 3, 2, 8, 10
SWAP_AT = 3  # the weight check that brings version 6: after 3 decode steps, so live rows switch at token index 4


def _generate(model, weight_check=None, check_every: int = 1):
    engine = make_engine(model, max_prompt_length=P, max_response_length=R, max_num_seqs=B * N)
    engine.check_every = check_every
    prompts = make_prompts(B, P, model.config.vocab_size, meta={"n": N, "seeds": [11, 12, 13]})
    return engine, engine.generate(prompts, weight_check=weight_check) if weight_check else engine.generate(prompts)


class _Swap:
    """A weight check that returns version 5, and from its SWAP_AT-th poll on version 6 (after running `change`
    on the engine's module and re-syncing the engine, as the rollout worker does)."""

    def __init__(self, change) -> None:
        self.change, self.calls, self.engine = change, 0, None

    def __call__(self) -> int:
        if self.calls == SWAP_AT:
            with torch.no_grad():
                self.change(self.engine.module)
            self.engine.sync_weights()
        self.calls += 1
        return 5 if self.calls <= SWAP_AT else 6


def _run_with_swap(change):
    model = make_model("tiny")
    swap = _Swap(change)
    engine = make_engine(model, max_prompt_length=P, max_response_length=R, max_num_seqs=B * N)
    swap.engine = engine
    prompts = make_prompts(B, P, model.config.vocab_size, meta={"n": N, "seeds": [11, 12, 13]})
    return engine.generate(prompts, weight_check=swap), swap


def _expected_versions(lengths: torch.Tensor) -> torch.Tensor:
    """Rows still decoding at the swap (length > SWAP_AT + 1) switch at token SWAP_AT + 1; the others are all 5."""
    t = torch.arange(R)[None]
    late = (t >= SWAP_AT + 1) & (lengths[:, None] > SWAP_AT + 1)
    return torch.where(late, 6, 5)


def test_without_a_swap_versions_are_constant_and_samples_unchanged() -> None:
    _, plain = _generate(make_model("tiny"))
    _, checked = _generate(make_model("tiny"), weight_check=lambda: 7)
    assert "rollout_policy_version" not in plain.batch
    for key in ("responses", "rollout_log_probs", "response_mask"):
        assert torch.equal(plain.batch[key], checked.batch[key]), key
    assert bool((checked.batch["rollout_policy_version"] == 7).all())
    assert checked.meta_info["metrics"]["rollout/weight_swaps"] == 0


def test_tokens_before_the_swap_carry_v_and_after_it_v_plus_1() -> None:
    _, base = _generate(make_model("tiny"), weight_check=lambda: 5)
    out, swap = _run_with_swap(lambda m: m.lm_head.weight.zero_())  # new policy: uniform over the vocabulary
    lengths = out.batch["response_mask"].sum(-1)
    assert int((lengths > SWAP_AT + 1).sum()) >= 2, "too few rows were still decoding at the swap: the test is void"
    versions = out.batch["rollout_policy_version"]
    assert torch.equal(versions, _expected_versions(lengths))
    assert out.meta_info["metrics"]["rollout/weight_swaps"] == 1
    # before the swap: the very samples (and log-probs) of the old weights
    k = SWAP_AT + 1
    assert torch.equal(out.batch["responses"][:, :k], base.batch["responses"][:, :k])
    assert torch.equal(out.batch["rollout_log_probs"][:, :k], base.batch["rollout_log_probs"][:, :k])
    # after it: sampled from the new weights, and the rollout log-probs (the IS denominator) are theirs, per token
    new = (versions == 6) & out.batch["response_mask"].bool()
    uniform = -math.log(make_model("tiny").config.vocab_size)
    torch.testing.assert_close(out.batch["rollout_log_probs"][new], torch.full((int(new.sum()),), uniform),
                               rtol=0, atol=1e-5)
    # (the old policy's log-probs at those positions were not uniform: the check above can tell the two apart)
    assert float((base.batch["rollout_log_probs"][new] - uniform).abs().max()) > 0.5


def test_a_version_only_swap_draws_the_same_samples() -> None:
    """New label, same weights: the samples equal a run without the swap (continue == abort when nothing moves)."""
    _, base = _generate(make_model("tiny"), weight_check=lambda: 5)
    out, _ = _run_with_swap(lambda m: None)
    for key in ("responses", "rollout_log_probs", "response_mask"):
        assert torch.equal(out.batch[key], base.batch[key]), key
    assert torch.equal(out.batch["rollout_policy_version"], _expected_versions(out.batch["response_mask"].sum(-1)))


def test_versions_must_not_go_back() -> None:
    model = make_model("tiny")
    calls = iter([4, 3])
    with pytest.raises(RuntimeError, match="from policy version 4 back to 3"):
        _generate(copy.deepcopy(model), weight_check=lambda: next(calls))
