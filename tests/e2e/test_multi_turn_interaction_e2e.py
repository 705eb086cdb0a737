"""GRPO with an interaction (a simulated user) on the tiny model: the first user message extends the prompts, user
turns are context (no loss), and each judged turn's reward reaches `token_level_scores` on its last model token,
next to the outcome reward on the trajectory's last token."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from hybridflow.agentic.interactions import Interaction, InteractionStep
from hybridflow.commands.quickstart import QUICKSTART_YAML
from hybridflow.config import load_config
from hybridflow.trainer.ppo import PPOTrainer

TURN_REWARD = 0.25


class Again(Interaction):
    """Opens with "go"; answers every turn with "more" and rewards it."""

    def reset(self, kwargs):
        return "go"

    def step(self, assistant_message):
        return InteractionStep("more", TURN_REWARD)


def test_interaction_turn_rewards_reach_the_scores(tmp_path: Path) -> None:
    icfg = tmp_path / "interaction.yaml"
    icfg.write_text("interaction:\n  - name: again\n    class_name: tests.e2e.test_multi_turn_interaction_e2e.Again\n")
    cfg = load_config([QUICKSTART_YAML], [
        f"trainer.run_dir={tmp_path}/run", f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.logger=[jsonl]",
        "trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "data.val_size=8", "data.train_size=64", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
        "rollout.n=4", "data.chat_template=null", "data.max_prompt_length=48", "data.max_response_length=64",
        "rollout.multi_turn.enable=true", "rollout.multi_turn.format=hermes_plain",
        f"rollout.multi_turn.interaction_config_path={icfg}", "rollout.multi_turn.max_user_turns=2",
        f"rollout.stop_token_ids={list(range(3, 99, 3))}",  # short turns from a random model
    ])
    trainer = PPOTrainer(cfg)
    seen = []
    advantages = trainer.algorithm.advantages  # the scored batch (rewards in), whichever order the step scores in

    def spy(batch, metrics):
        seen.append(batch)
        return advantages(batch, metrics)

    trainer.algorithm.advantages = spy
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    (m,) = [m for m in history if m.get("training/global_step", 0) >= 1]
    assert not {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
    assert m["num_user_turns/max"] >= 1 and m["reward/turn_rewards/mean"] > 0 and "actor/pg_loss" in m, m
    b = seen[0].batch
    mask, turn, scores = b["response_mask"].bool(), b["turn_rewards"], b["token_level_scores"]
    assert (turn[~mask] == 0).all()
    last = mask.long().cumsum(1).argmax(1)  # each row's last model token: where the outcome reward sits
    inner = turn.clone()
    inner[torch.arange(len(inner)), last] = 0
    assert (inner > 0).any(), "some trajectory must have a judged turn before its last one"
    # before the last token the scores are exactly the turn rewards; at the last one, outcome + turn reward
    sel = inner != 0
    assert torch.equal(scores[sel], turn[sel])
    resp_len = b["attention_mask"][:, -b["responses"].shape[1]:].sum(1)
    assert (mask.sum(1) < resp_len).any(), "some trajectory must hold user tokens"
    assert torch.all(b["rollout_log_probs"][~mask] == 0)
