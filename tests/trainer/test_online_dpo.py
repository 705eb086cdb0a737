"""Online DPO on the one loop (tiny model, CPU): sampled groups become interleaved (best, worst) pairs, tied groups
are skipped and counted; at step 1 the reference (frozen, or LoRA adapters off) is the policy, so the loss is ln 2;
4 straight steps equal 2 + crash + resume + 2 bit for bit; config errors name the key; `hybridflow dpo --online`."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from ppo_testlib import SimulatedCrash, tiny_ppo_config

from hybridflow.algorithms.preference_pairs import best_worst_pairs
from hybridflow.cli import main
from hybridflow.config import ConfigError
from hybridflow.protocol import DataProto
from hybridflow.trainer.online_dpo import OnlineDPOTrainer, pair_batch

NONDETERMINISTIC = ("timing/", "perf/", "tokens_per_s", "step_time_s", "throughput", "mfu")
PER_SEGMENT = ("data/skipped_rows",)


def _cfg(tmp_path: Path, *extra: str):
    return tiny_ppo_config(tmp_path, tmp_path / "ckpt", 2, "dpo.online=true", "dpo.beta=0.5", *extra)


def _fit(cfg, crash_at: int | None = None):
    trainer = OnlineDPOTrainer(cfg)
    step = trainer.step

    def crashing(batch):
        if trainer.global_step == crash_at:
            raise SimulatedCrash(f"simulated crash at step {crash_at}")
        return step(batch)

    trainer.step = crashing
    try:
        trainer.fit()
        worker = None  # the local backend's in-process actor worker (Ray's live in other processes)
        if cfg.trainer.backend == "local":
            worker = trainer.algorithm.groups.actor.worker_group._handles[0].worker.roles["actor_rollout_ref"]
    except SimulatedCrash:
        assert crash_at is not None
        worker = None
    finally:
        trainer.close()
    return trainer.history, worker


def test_pair_batch_interleaves_and_trims_to_whole_pairs_per_rank() -> None:
    R = 3
    gen = DataProto.from_dict({"input_ids": torch.arange(6 * 5).view(6, 5), "attention_mask": torch.ones(6, 5),
                               "position_ids": torch.arange(5).repeat(6, 1), "responses": torch.arange(6 * R).view(6, R),
                               "response_mask": torch.ones(6, R, dtype=torch.long),
                               "rollout_log_probs": torch.zeros(6, R)},
                              non_tensors={"uid": np.array(["a", "a", "b", "b", "c", "c"], dtype=object)})
    pairs = best_worst_pairs(torch.tensor([0.0, 1.0, 2.0, 1.0, 0.0, 3.0]), gen.non_tensor_batch["uid"])
    one = pair_batch(gen, pairs, world_size=1)
    assert one.batch["responses"][:, 0].tolist() == [3, 0, 6, 9, 15, 12]  # rows 1,0 | 2,3 | 5,4
    assert one.batch["pair_chosen"].tolist() == [1, 0, 1, 0, 1, 0]
    assert "rollout_log_probs" not in one.batch  # only the model inputs and the loss mask travel
    two = pair_batch(gen, pairs, world_size=2)  # 3 pairs over 2 ranks: the last pair is dropped
    assert len(two) == 4 and two.batch["responses"][:, 0].tolist() == [3, 0, 6, 9]


@pytest.mark.parametrize("lora", [False, True])
def test_first_step_is_ln2_and_metrics(tmp_path: Path, lora: bool) -> None:
    extra = ("model.lora.rank=4", "model.lora.alpha=8") if lora else ()
    history, worker = _fit(_cfg(tmp_path, "trainer.total_training_steps=2", *extra))
    assert (worker.ref is None) == lora  # LoRA: the reference is the actor with its adapters off
    first = history[0]
    assert first["online_dpo/pairs"] + first["online_dpo/tied_groups"] == 2  # data.train_batch_size prompts
    assert first["online_dpo/pairs"] > 0  # the toy reward separates responses
    assert first["actor/loss"] == pytest.approx(math.log(2), abs=1e-6) and first["rewards/margins"] == 0.0
    assert all(k in history[-1] for k in ("online_dpo/frac_tied_groups", "reward/score/mean", "timing/gen",
                                          "timing/pair", "response_length/mean"))
    trained = [m for m in history if m["online_dpo/pairs"]]
    assert trained and all("rewards/accuracies" in m and "logps/chosen" in m for m in trained)


def test_resume_is_bit_exact(tmp_path: Path) -> None:
    common = ("trainer.total_training_steps=4", "trainer.checkpoint.save_freq=2", "trainer.resume_mode=auto",
              "trainer.checkpoint.async_save=false")
    straight, a = _fit(tiny_ppo_config(tmp_path, tmp_path / "a", 2, "dpo.online=true", "dpo.beta=0.5", *common))
    crashed, _ = _fit(tiny_ppo_config(tmp_path, tmp_path / "b", 2, "dpo.online=true", "dpo.beta=0.5", *common),
                      crash_at=3)
    resumed, b = _fit(tiny_ppo_config(tmp_path, tmp_path / "b", 2, "dpo.online=true", "dpo.beta=0.5", *common))
    assert [m["training/global_step"] for m in crashed + resumed] == [1, 2, 3, 4]
    assert sum(m["online_dpo/pairs"] for m in straight) > 0 and straight[-1]["actor/loss"] != straight[0]["actor/loss"]

    def deterministic(m: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in m.items() if not any(s in k for s in NONDETERMINISTIC + PER_SEGMENT)}

    assert [deterministic(m) for m in straight] == [deterministic(m) for m in crashed + resumed]
    wa, wb = a.actor.module.state_dict(), b.actor.module.state_dict()
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("override,match", [
    ("rollout.n=1", "rollout.n >= 2"),
    ("actor.ppo_micro_batch_size_per_gpu=3", "actor.ppo_micro_batch_size_per_gpu=4"),
    ("actor.use_dynamic_bsz=true", "actor.use_dynamic_bsz=false"),
])
def test_bad_online_config_names_the_key(tmp_path: Path, override: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        _cfg(tmp_path, override)


def test_cli_online_flag(tmp_path: Path, capsys) -> None:
    cfg_args = ["trainer.device=cpu", "trainer.backend=local", "trainer.logger=[]",
                "model.override_config={num_hidden_layers: 1}", "data.train_size=8", "data.val_size=2",
                "data.train_batch_size=2", "data.max_response_length=6", "rollout.n=2", "actor.ppo_mini_batch_size=2",
                "trainer.total_training_steps=1", "trainer.val_before_train=false", f"trainer.run_dir={tmp_path}/run",
                f"trainer.default_local_dir={tmp_path}/ckpt"]
    rc = main(["dpo", "--online", *cfg_args])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "online DPO finished: 1 of 1 steps" in out.out and "val/accuracy" in out.out


def test_train_command_refuses_online_dpo(capsys) -> None:
    assert main(["train", "trainer.device=cpu", "dpo.online=true", "rollout.n=2"]) == 2
    assert "run by `hybridflow dpo`" in capsys.readouterr().err


@pytest.mark.parametrize("loss", ["simpo", "ipo"])
def test_other_losses_run_online(tmp_path: Path, loss: str) -> None:
    extra = ("dpo.beta=2.0",) if loss == "simpo" else ()
    history, worker = _fit(_cfg(tmp_path, "trainer.total_training_steps=2", f"dpo.loss_type={loss}", *extra))
    assert (worker.ref is None) == (loss == "simpo")  # SimPO: reference-free, no second model
    trained = [m for m in history if m["online_dpo/pairs"]]
    assert trained and all(math.isfinite(m["actor/loss"]) for m in trained)


@pytest.mark.ray
def test_two_ranks_hold_whole_pairs(tmp_path: Path) -> None:
    common = ("trainer.total_training_steps=2", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8",
              "actor.ppo_micro_batch_size_per_gpu=4", "trainer.checkpoint.save_freq=0")
    local, _ = _fit(tiny_ppo_config(tmp_path, tmp_path / "l", 8, "dpo.online=true", "dpo.beta=0.5", *common))
    threads = torch.get_num_threads()
    try:
        ray, _ = _fit(tiny_ppo_config(tmp_path, tmp_path / "r", 8, "dpo.online=true", "dpo.beta=0.5", *common,
                                      "trainer.backend=ray", "trainer.n_gpus_per_node=2"))
    finally:
        torch.set_num_threads(threads)
    l1, r1 = local[0], ray[0]
    # the same samples and pairs (seeds per prompt), trimmed to whole pairs on each of the 2 ranks
    assert r1["reward/score/mean"] == pytest.approx(l1["reward/score/mean"], abs=1e-6)
    assert r1["online_dpo/pairs"] == l1["online_dpo/pairs"] // 2 * 2 > 0
    assert r1["online_dpo/dropped_pairs"] == l1["online_dpo/pairs"] % 2
    assert r1["actor/loss"] == pytest.approx(math.log(2), abs=1e-6)
    for m in ray:  # every step (local step 2 pairs 7 prompts: 6 trained on 2 ranks, 1 dropped)
        assert m["online_dpo/pairs"] % 2 == 0 and math.isfinite(m["actor/loss"])
        assert m["online_dpo/pairs"] + m["online_dpo/dropped_pairs"] + m["online_dpo/tied_groups"] == 8
