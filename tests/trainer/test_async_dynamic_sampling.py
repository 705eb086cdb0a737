"""DAPO dynamic sampling (`algorithm.filter_groups`) and online DPO in the non-sync modes: the driver scores
each finished request, keeps the informative groups and asks the rollout workers for more prompts while a batch is
short; online DPO takes its batches from the driver and sends its weights after each update."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from ppo_testlib import tiny_ppo_config

from hybridflow.trainer.online_dpo import OnlineDPOTrainer
from hybridflow.trainer.ppo import PPOTrainer

# Odd answers: every response scores 0, an uninformative group the filter drops (about half the prompts); even
# answers: the responses' characters decide (rarely all equal).
PARITY_REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                 "    if int(ground_truth) % 2:\n"
                 "        return 0.0\n"
                 "    return (sum(map(ord, solution_str)) % 5) / 4.0\n")
FLAT_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.5\n"


def _cfg(tmp: Path, mode: str, reward: str, *extra: str):
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "dyn_reward.py"
    path.write_text(reward)
    return tiny_ppo_config(tmp, tmp / "ckpt", 2, f"trainer.mode={mode}", "trainer.total_training_steps=3",
                           "trainer.resume_mode=disable", "trainer.logger=[]", f"trainer.run_dir={tmp}/run",
                           f"reward.custom.path={path}", "algorithm.filter_groups.enable=true", *extra)


def _fit(cfg, scored: list[dict[str, Any]], trained: list[dict[str, Any]],
         trainer_cls: type = PPOTrainer) -> list[dict[str, float]]:
    """Run `cfg`; `scored` gets every reward call's rows (each generation round or request), `trained` each
    step's batch as trained (after filtering)."""
    trainer = trainer_cls(cfg)
    alg = trainer.algorithm
    reward, update = alg.reward, alg.actor.update_actor

    def recording_reward(batch, metrics):
        out = reward(batch, metrics)
        scored.append({"uid": list(out.non_tensor_batch["uid"]), "responses": out.batch["responses"].clone(),
                       "scores": out.batch["token_level_scores"].sum(-1).clone(),
                       "version": out.batch.get("policy_version")})  # set by the rollout workers only
        return out

    def recording_update(batch, **kwargs):
        trained.append({"uid": list(batch.non_tensor_batch["uid"]),
                        "scores": batch.batch["token_level_scores"].sum(-1).clone(),
                        "version": batch.batch.get("policy_version")})
        return update(batch, **kwargs)

    alg.reward = recording_reward
    alg.actor.update_actor = recording_update
    try:
        return [m for m in trainer.fit() if m.get("training/global_step", 0) >= 1]
    finally:
        trainer.close()


def _informative(batch: dict[str, Any]) -> bool:
    """Every group of the trained batch has responses that scored differently."""
    groups: dict[str, list[float]] = {}
    for uid, s in zip(batch["uid"], batch["scores"].tolist()):
        groups.setdefault(uid, []).append(s)
    return all(max(g) > min(g) for g in groups.values())


def test_one_step_off_dynamic_sampling_matches_sync_at_zero_effect_learning_rate(tmp_path: Path) -> None:
    # at lr 1e-30 the policy does not move (test_async_modes), so the driver's rounds must be sync mode's: the same
    # prompts and samples per round, the same extra rounds, the same filtered batches
    runs: dict[str, tuple[list, list, list]] = {}
    for mode in ("sync", "one_step_off"):
        scored: list[dict[str, Any]] = []
        trained: list[dict[str, Any]] = []
        history = _fit(_cfg(tmp_path / mode, mode, PARITY_REWARD, "actor.optim.lr=1e-30",
                            "algorithm.filter_groups.max_num_gen_batches=4"), scored, trained)
        runs[mode] = (history, scored, trained)
    (h_sync, s_sync, t_sync), (h_off, s_off, t_off) = runs["sync"], runs["one_step_off"]
    assert len(h_sync) == len(h_off) == 3 and len(t_sync) == len(t_off) == 3
    assert len(s_sync) == len(s_off) > 3, "no step needed an extra round: the test reward must drop groups"
    for i, (a, b) in enumerate(zip(s_sync, s_off)):
        assert a["uid"] == b["uid"] and torch.equal(a["responses"], b["responses"]), f"round {i}"
        assert b["version"] is not None, f"round {i} was not generated on the rollout workers"
    for step, (a, b, ma, mb) in enumerate(zip(t_sync, t_off, h_sync, h_off), start=1):
        assert a["uid"] == b["uid"] and torch.equal(a["scores"], b["scores"]), f"step {step}"
        assert _informative(b), f"step {step} trained an all-equal group"
        for key in ("data/gen_batches", "data/frac_groups_filtered", "reward/score/mean", "reward/score/max"):
            assert ma[key] == mb[key], (step, key, ma[key], mb[key])
        assert mb["timing/reward"] > 0  # the driver scored it
    assert max(m["data/gen_batches"] for m in h_off) > 1
    assert [int(t["version"].max()) for t in t_off][0] == 0


def test_async_dynamic_sampling_fills_batches_with_informative_groups(tmp_path: Path) -> None:
    scored: list[dict[str, Any]] = []
    trained: list[dict[str, Any]] = []
    history = _fit(_cfg(tmp_path, "async", PARITY_REWARD, "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                        "trainer.async.chunk_prompts=1", "trainer.async.max_staleness=1",
                        "algorithm.filter_groups.max_num_gen_batches=8"), scored, trained)
    assert len(history) == len(trained) == 3
    assert all(len(s["uid"]) == 4 for s in scored)  # one prompt (4 samples) per request, scored as it arrives
    for step, (m, t) in enumerate(zip(history, trained), start=1):
        assert len(t["uid"]) == 16 and _informative(t), f"step {step}: {t['uid']}"
        assert (step - 1) - int(t["version"].min()) <= 1  # the staleness bound holds for the extra prompts too
        assert m["async/requests"] == 4 * m["data/gen_batches"] >= 4
    assert max(m["data/gen_batches"] for m in history) > 1 and max(m["data/frac_groups_filtered"]
                                                                    for m in history) > 0
    kept = {u for t in trained for u in t["uid"]}
    assert len(kept) == 3 * 4 and len({u for s in scored for u in s["uid"]}) > len(kept)


def test_async_dynamic_sampling_budget_spent_trains_on_the_last_rows(tmp_path: Path) -> None:
    # every group ties: after max_num_gen_batches batches of prompts the step trains on the newest rows unfiltered
    scored: list[dict[str, Any]] = []
    trained: list[dict[str, Any]] = []
    history = _fit(_cfg(tmp_path, "async", FLAT_REWARD, "trainer.async.chunk_prompts=1",
                        "algorithm.filter_groups.max_num_gen_batches=2"), scored, trained)
    assert len(history) == 3
    for m in history:
        assert m["data/gen_batches"] == 2 and m["data/frac_groups_filtered"] == 1.0
    consumed = 0
    for t in trained:  # 2 batches of 2 prompts consumed per step: the last 2 requests' rows are trained
        consumed += 4
        newest = [u for s in scored[consumed - 2:consumed] for u in s["uid"]]
        assert t["uid"] == newest


def test_online_dpo_one_step_off_matches_sync_at_zero_effect_learning_rate(tmp_path: Path) -> None:
    runs: dict[str, tuple[list, list]] = {}
    for mode in ("sync", "one_step_off"):
        scored: list[dict[str, Any]] = []
        history = _fit(_cfg(tmp_path / mode, mode, PARITY_REWARD, "algorithm.filter_groups.enable=false",
                            "dpo.online=true", "dpo.beta=0.5", "actor.optim.lr=1e-30"), scored, [],
                       trainer_cls=OnlineDPOTrainer)
        runs[mode] = (history, scored)
    (h_sync, s_sync), (h_off, s_off) = runs["sync"], runs["one_step_off"]
    assert len(h_sync) == len(h_off) == len(s_sync) == len(s_off) == 3
    for step, (a, b, ma, mb) in enumerate(zip(s_sync, s_off, h_sync, h_off), start=1):
        assert a["uid"] == b["uid"] and torch.equal(a["responses"], b["responses"]), f"step {step}"
        assert ma["online_dpo/pairs"] == mb["online_dpo/pairs"]
        assert mb["staleness/max"] == float(min(step - 1, 1)) and "timing/weight_sync" in mb
    assert sum(m["online_dpo/pairs"] for m in h_off) > 0


def test_online_dpo_async_trains_within_the_staleness_bound(tmp_path: Path) -> None:
    scored: list[dict[str, Any]] = []
    history = _fit(_cfg(tmp_path, "async", PARITY_REWARD, "algorithm.filter_groups.enable=false", "dpo.online=true",
                        "dpo.beta=0.5", "trainer.async.chunk_prompts=1", "trainer.async.max_staleness=1",
                        "trainer.async.partial_rollout=continue"), scored, [], trainer_cls=OnlineDPOTrainer)
    assert len(history) == len(scored) == 3
    assert [m["staleness/max"] for m in history] == [0.0, 1.0, 1.0]
    assert all(m["async/requests"] == 2 for m in history)  # two one-prompt requests per batch of 2 prompts
    assert sum(m["online_dpo/pairs"] for m in history) > 0 and "actor/loss" in history[-1]


def test_extra_prompts_come_from_their_own_loader(tmp_path: Path) -> None:
    # sync mode's extra rounds once re-iterated the run's own loader: they drew the batches the run trained next
    # (each prompt twice per epoch) and moved the saved data position; now a loader of their own feeds them
    scored: list[dict[str, Any]] = []
    history = _fit(_cfg(tmp_path, "sync", PARITY_REWARD, "trainer.total_training_steps=4",
                        "algorithm.filter_groups.max_num_gen_batches=4"), scored, [])
    assert len(history) == 4 and len(scored) > 4
    main = [u for s in scored for u in dict.fromkeys(s["uid"]) if "-extra-" not in u]
    extra = [u for s in scored for u in dict.fromkeys(s["uid"]) if "-extra-" in u]
    assert len(main) == 4 * 2 and len(set(main)) == len(main)  # one loader batch of 2 prompts per step, no repeats
    assert extra and all(u.startswith("train-extra-e") for u in extra)
