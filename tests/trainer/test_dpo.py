"""DPO on the one loop: at step 0 the reference (frozen engine, or the LoRA actor with adapters disabled) equals the
policy, so rewards are exactly 0 and the loss is ln 2; SimPO builds no reference; training moves the implicit
rewards; 4 straight steps equal 2 + resume + 2 bit for bit; bad config names the key; the CLI runs and exports."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from hybridflow.cli import main
from hybridflow.config import ConfigError, load_config
from hybridflow.controller.errors import WorkerError
from hybridflow.trainer.dpo import DPOTrainer

NONDETERMINISTIC = ("timing/", "tokens_per_s", "step_time_s", "mfu")


def _args(tmp_path, *extra: str) -> list[str]:
    return ["trainer.device=cpu", "trainer.backend=local", "trainer.logger=[]", f"trainer.run_dir={tmp_path}/run",
            f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.val_before_train=false",
            "trainer.resume_mode=disable", "trainer.checkpoint.save_freq=0", "trainer.test_freq=-1",
            "data.task=arithmetic", "data.train_size=64", "data.val_size=16", "dpo.batch_size=8",
            "dpo.micro_batch_size_per_gpu=2", "dpo.optim.lr=1e-3", "dpo.optim.lr_warmup_steps_ratio=0", *extra]


def _worker(trainer: DPOTrainer):
    return trainer.algorithm.group.worker_group._handles[0].worker  # the local backend's in-process worker


def _fit(tmp_path, *extra: str) -> tuple[list[dict[str, float]], Any]:
    """(per-step metrics, the worker — kept past `close`)."""
    trainer = DPOTrainer(load_config([], _args(tmp_path, *extra)))
    try:
        trainer.fit()
        worker = _worker(trainer)
    finally:
        trainer.close()
    return trainer.history, worker


@pytest.mark.parametrize("lora", [False, True])
def test_first_step_rewards_are_zero_then_training_moves_them(tmp_path, lora: bool) -> None:
    extra = ("model.lora.rank=4", "model.lora.alpha=8", "dpo.optim.lr=1e-2") if lora else ()
    history, worker = _fit(tmp_path, "dpo.total_steps=3", *extra)
    assert (worker.ref is None) == lora  # LoRA: no second model
    first, last = history[0], history[-1]
    assert first["rewards/chosen"] == 0.0 and first["rewards/margins"] == 0.0 and first["rewards/accuracies"] == 0.0
    assert first["dpo/loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert last["rewards/margins"] != 0.0 and last["dpo/loss"] != first["dpo/loss"]
    assert "val/logp_accuracy" in last and "val/accuracy" in last


def test_simpo_is_reference_free(tmp_path) -> None:
    history, worker = _fit(tmp_path, "dpo.total_steps=2", "dpo.loss_type=simpo", "dpo.beta=2.0")
    assert worker.ref is None
    assert "timing/ref" in history[0] and history[0]["rewards/chosen"] != 0.0  # β · mean log π, no reference
    assert math.isfinite(history[-1]["dpo/loss"])


@pytest.mark.parametrize("precompute", [False, True])
def test_resume_is_bit_exact(tmp_path, precompute: bool) -> None:
    ckpt = ("trainer.checkpoint.save_freq=2", "trainer.checkpoint.async_save=false", "trainer.resume_mode=auto",
            "dpo.total_steps=4", f"dpo.precompute_ref={str(precompute).lower()}")
    straight, a = _fit(tmp_path / "a", *ckpt)
    # the interrupted run: stops after step 2 (saved there; the LR schedule is still sized for 4), then a fresh
    # trainer resumes to 4
    part = DPOTrainer(load_config([], _args(tmp_path / "c", *ckpt)))
    part.total_steps = 2
    try:
        part.fit()
    finally:
        part.close()
    resumed, c = _fit(tmp_path / "c", *ckpt)
    assert [m["training/global_step"] for m in resumed] == [3, 4]
    def deterministic(m: dict[str, float]) -> dict[str, float]:  # the interrupted run also validated at its end;
        # data/skipped_rows comes with the first logged step of each process (the resumed one too)
        return {k: v for k, v in m.items() if not any(s in k for s in (*NONDETERMINISTIC, "val/", "data/skipped"))}

    assert [deterministic(m) for m in straight] == [deterministic(m) for m in part.history + resumed]
    assert straight[-1]["val/loss"] == resumed[-1]["val/loss"]
    wa, wc = a.engine.module.state_dict(), c.engine.module.state_dict()
    assert wa.keys() == wc.keys() and all(torch.equal(wa[k], wc[k]) for k in wa)


def test_precomputed_reference_equals_per_batch_and_frees_the_model(tmp_path) -> None:
    trainer = DPOTrainer(load_config([], _args(tmp_path, "dpo.total_steps=2")))
    try:
        alg = trainer.algorithm
        batch = next(iter(alg.loader))  # a shuffled training batch: other rows and widths than the first pass saw
        per_batch = alg.group.compute_ref_log_prob(batch).batch["ref_log_prob"]
        alg.precompute_reference()
        assert _worker(trainer).ref is None  # the frozen reference is freed
        assert len(alg.ref_cache["train"]) == 2 * len(alg.train_ds) and len(alg.ref_cache["val"]) == 2 * len(alg.val_ds)
        cached = alg.ref_cache["train"].lookup(batch)
        mask = batch.batch["response_mask"].bool()
        assert cached.shape == per_batch.shape and not cached[~mask].any()
        # the same model on the same tokens in another batch (bit-equal at the default CPU numerics; other kernels,
        # e.g. the AVX2 emulation, may round a packed batch of another width differently)
        torch.testing.assert_close(cached, per_batch * mask, rtol=0, atol=1e-5)
        with pytest.raises(WorkerError, match="no reference"):  # nothing can silently fall back to a freed model
            alg.group.compute_ref_log_prob(batch)
    finally:
        trainer.close()


def test_precompute_ref_trains_like_per_batch(tmp_path) -> None:
    per_batch, _ = _fit(tmp_path / "a", "dpo.total_steps=3", "trainer.test_freq=3")
    pre, worker = _fit(tmp_path / "b", "dpo.total_steps=3", "trainer.test_freq=3", "dpo.precompute_ref=true")
    assert worker.ref is None
    for key in ("dpo/loss", "rewards/margins", "logps/chosen", "dpo/grad_norm"):
        assert [m[key] for m in pre] == pytest.approx([m[key] for m in per_batch], rel=1e-4, abs=1e-5), key
    assert pre[-1]["val/loss"] == pytest.approx(per_batch[-1]["val/loss"], rel=1e-4)
    assert pre[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)  # step 1: the cached reference is the policy


@pytest.mark.parametrize("override,key", [("dpo.loss_type=kto", "dpo.loss_type"), ("dpo.beta=0", "dpo.beta"),
                                          ("dpo.label_smoothing=0.5", "dpo.label_smoothing")])
def test_bad_config_names_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_config([], [override])


def test_cli_trains_and_exports(tmp_path, capsys) -> None:
    rc = main(["dpo", *_args(tmp_path, "dpo.total_steps=2", "dpo.loss_type=ipo", f"dpo.export_dir={tmp_path}/hf")])
    assert rc == 0, capsys.readouterr()
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "config.json").is_file()
    assert "IPO finished: 2 of 2 steps" in capsys.readouterr().out


def test_greedy_task_accuracy_is_measured_apart_from_the_implicit_one(tmp_path) -> None:
    """At step 0 every implicit reward is 0, so `val/rewards/accuracies` is 0; `val/accuracy` is what the policy
    answers greedily, graded by the task's scorer — the number `hybridflow train` validates the same model to."""
    from pathlib import Path

    from hybridflow.commands.quickstart import QUICKSTART_YAML
    from hybridflow.trainer.ppo import PPOTrainer

    sft = Path(__file__).resolve().parents[1] / "assets" / "sft_arithmetic"
    common = [f"trainer.run_dir={tmp_path}/run", f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.logger=[]",
              "trainer.resume_mode=disable", "trainer.checkpoint.save_freq=0", "data.val_size=32"]
    trainer = DPOTrainer(load_config([QUICKSTART_YAML], [
        *common, f"dpo.init_from={sft}", "data.train_size=16", "dpo.batch_size=8", "dpo.micro_batch_size_per_gpu=8",
        "dpo.total_steps=1", "trainer.val_before_train=true"]))
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    step0 = history[0]
    assert step0["training/global_step"] == 0 and step0["val/rewards/accuracies"] == 0.0
    ppo = PPOTrainer(load_config([QUICKSTART_YAML], [*common, f"model.path={sft}"]))
    try:
        truth = ppo.validator.run(step=0)
    finally:
        ppo.close()
    assert step0["val/accuracy"] == truth["val/accuracy"] > 0.0  # the SFT model answers some problems right
    assert step0["val/reward"] == truth["val/reward"] and "val/hybridflow/arithmetic/accuracy" in step0
    assert "val/accuracy" in history[-1] and "val/rewards/accuracies" in history[-1]  # and after training


def test_greedy_validation_can_be_turned_off(tmp_path) -> None:
    history, worker = _fit(tmp_path, "dpo.total_steps=1", "dpo.val_generate=false")
    assert worker.rollout is None and "val/accuracy" not in history[-1] and "val/rewards/accuracies" in history[-1]
