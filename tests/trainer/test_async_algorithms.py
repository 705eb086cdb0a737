"""Algorithms in the non-sync modes: ReMax's greedy baseline and LoRA work on the separate rollout
workers (DAPO dynamic sampling and online DPO: test_async_dynamic_sampling.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from ppo_testlib import tiny_ppo_config

from hybridflow.trainer.ppo import PPOTrainer

STEPS = 3


def _cfg(tmp: Path, mode: str, *extra: str):
    tmp.mkdir(parents=True, exist_ok=True)
    return tiny_ppo_config(tmp, tmp / "ckpt", 2, f"trainer.mode={mode}", f"trainer.total_training_steps={STEPS}",
                           "trainer.resume_mode=disable", "trainer.logger=[]", f"trainer.run_dir={tmp}/run", *extra)


def _fit(cfg, rows: list[dict[str, Any]], after=None) -> list[dict[str, float]]:
    trainer = PPOTrainer(cfg)
    reward = trainer.algorithm.reward

    def recording(batch, metrics):
        rows.append({"responses": batch.batch["responses"].clone(), "uid": list(batch.non_tensor_batch["uid"]),
                     "baseline": batch.batch.get("baseline_rewards")})
        out = reward(batch, metrics)
        rows[-1]["scores"] = out.batch["token_level_scores"].sum(-1).clone()
        return out

    trainer.algorithm.reward = recording
    try:
        history = [m for m in trainer.fit() if m.get("training/global_step", 0) >= 1]
        if after is not None:
            after(trainer)
        return history
    finally:
        trainer.close()


def test_remax_baseline_in_one_step_off_matches_sync_at_zero_effect_learning_rate(tmp_path: Path) -> None:
    # at lr 1e-30 the policy does not move (see test_async_modes), so the rollout worker's greedy baselines and
    # samples must be sync mode's, step for step
    runs: dict[str, list[dict[str, Any]]] = {}
    for mode in ("sync", "one_step_off"):
        runs[mode] = []
        history = _fit(_cfg(tmp_path / mode, mode, "algorithm.adv_estimator=remax", "actor.optim.lr=1e-30"),
                       runs[mode])
        assert len(history) == STEPS
    for step, (a, b) in enumerate(zip(runs["sync"], runs["one_step_off"]), start=1):
        assert a["uid"] == b["uid"] and torch.equal(a["responses"], b["responses"]), f"step {step}"
        assert b["baseline"] is not None and torch.equal(a["baseline"], b["baseline"]), f"step {step}"
    # the samples' own rewards differ from the baselines: a baseline scored on the samples would not match sync's
    assert any(not torch.equal(r["scores"], r["baseline"]) for r in runs["one_step_off"])


def test_remax_in_async_mode_trains_with_a_baseline_per_row(tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = []
    history = _fit(_cfg(tmp_path, "async", "algorithm.adv_estimator=remax", "trainer.async.chunk_prompts=1",
                        "trainer.async.partial_rollout=continue"), rows)
    assert len(history) == STEPS
    for r in rows:  # one greedy response per prompt, repeated over its n=4 samples
        base = r["baseline"].view(-1, 4)
        assert torch.equal(base, base[:, :1].expand_as(base))


def test_lora_one_step_off_sends_merged_weights(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    def check(trainer: PPOTrainer) -> None:
        from hybridflow.engine.lora import lora_layers

        host = trainer.groups.actor.worker_group._handles[0]  # noqa: SLF001 - in-process (local backend)
        worker = host.worker.roles["actor_rollout_ref"]
        module = worker.actor.module
        rollout = trainer.groups.rollout.weights()[0]
        def full(t: torch.Tensor) -> torch.Tensor:  # FSDP2 DTensor → the whole tensor (1 rank: no traffic)
            t = t.detach()
            return t.full_tensor() if hasattr(t, "full_tensor") else t

        plain = {n.replace(".base_layer.", "."): full(p) for n, p in module.named_parameters() if ".lora_" not in n}
        assert rollout.keys() == plain.keys()  # the plain model's names: no adapters on the rollout worker
        layers = dict(lora_layers(module))
        assert layers
        moved = 0.0
        for name, layer in layers.items():
            b, a, w = (full(x) for x in (layer.lora_B["default"].weight, layer.lora_A["default"].weight,
                                         layer.base_layer.weight))
            expected = w + layer.scaling["default"] * (b @ a)  # PEFT's own scaling
            torch.testing.assert_close(rollout[f"{name}.weight"], expected, rtol=0, atol=1e-6)
            moved = max(moved, float((expected - w).abs().max()))
        for name, t in plain.items():
            if not any(name == f"{n}.weight" for n in layers):
                assert torch.equal(rollout[name], t), name
        seen["moved"] = moved

    rows: list[dict[str, Any]] = []
    history = _fit(_cfg(tmp_path, "one_step_off", "model.lora.rank=4", "model.lora.alpha=8", "actor.optim.lr=1e-2"),
                   rows, after=check)
    assert len(history) == STEPS
    assert seen["moved"] > 1e-4  # the adapters trained, so the merged weights differ from the base
