"""Fault tests of PPO checkpointing end to end on CPU (tiny model, local backend): a run of 6 steps equals 3 steps
+ crash + resume + 3 steps bit-exactly (metrics, weights, optimizer; GAE so actor AND critic are in the one
colocated checkpoint; the reference run saves synchronously, the crashed one asynchronously); a `file://` mirror
alone is enough to resume; `hybridflow export` turns the PPO checkpoint into a model transformers loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from ppo_testlib import SimulatedCrash, tiny_ppo_config

from hybridflow.checkpoint.storage import read_flat_tensors
from hybridflow.trainer.ppo import PPOTrainer

# Wall-clock and memory numbers differ between runs; everything else must be identical.
NONDETERMINISTIC = ("timing/", "perf/", "tokens_per_s", "step_time_s", "throughput", "mfu")
PER_SEGMENT = ("data/skipped_rows",)  # logged with the first step of a run and of a resumed run (docs/metrics.md)


def _cfg(tmp_path: Path, root: str, *extra: str):
    return tiny_ppo_config(tmp_path, tmp_path / root, 1, "trainer.resume_mode=auto", *extra)


def _fit(cfg, crash_at: int | None = None) -> list[dict[str, float]]:
    """Train; with `crash_at`, raise inside that step (after the earlier steps' saves were submitted)."""
    trainer = PPOTrainer(cfg)
    step = trainer.step

    def crashing(batch):
        if trainer.global_step == crash_at:
            raise SimulatedCrash(f"simulated crash at step {crash_at}")
        return step(batch)

    trainer.step = crashing
    try:
        trainer.fit()
    except SimulatedCrash:
        assert crash_at is not None
    finally:
        trainer.close()  # waits for the in-flight save, as the atexit hook would on a clean exit
    return trainer.history


def _deterministic(m: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in m.items() if not any(s in k for s in NONDETERMINISTIC + PER_SEGMENT)}


def _tensors(ckpt: Path, component: str) -> dict[str, torch.Tensor]:
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    return read_flat_tensors(ckpt / component, meta["components"][component]["format"], "")


def test_resume_after_crash_is_bit_exact(tmp_path: Path) -> None:
    common = ("algorithm.adv_estimator=gae", "trainer.total_training_steps=6", "trainer.checkpoint.save_freq=3")
    straight = _fit(_cfg(tmp_path, "a", *common, "trainer.checkpoint.async_save=false"))
    crashed = _fit(_cfg(tmp_path, "b", *common, "trainer.checkpoint.async_save=true"), crash_at=4)
    resumed = _fit(_cfg(tmp_path, "b", *common, "trainer.checkpoint.async_save=true"))

    assert [m["training/global_step"] for m in straight] == [1, 2, 3, 4, 5, 6]
    assert [m["training/global_step"] for m in crashed] == [1, 2, 3]
    assert [m["training/global_step"] for m in resumed] == [4, 5, 6]
    assert straight[3]["actor/loss"] != straight[4]["actor/loss"]  # the run really trains
    for a, b in zip(straight, crashed + resumed):
        assert _deterministic(a) == _deterministic(b), a["training/global_step"]
    assert "val/reward" in resumed[-1] and "critic/loss" in resumed[-1]

    for component in ("actor", "critic"):  # weights AND optimizer state, bit for bit
        a = _tensors(tmp_path / "a" / "global_step_6", component)
        b = _tensors(tmp_path / "b" / "global_step_6", component)
        assert a.keys() == b.keys() and any(k.startswith("optimizer") for k in a)
        for k in a:
            assert torch.equal(a[k], b[k]), (component, k)
        first = _tensors(tmp_path / "a" / "global_step_3", component)
        assert not all(torch.equal(first[k], a[k]) for k in a if k.startswith("model/"))


def test_remote_only_resume_and_hf_export(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from hybridflow.cli import main

    remote = f"file://{tmp_path / 'remote'}"  # no trailing slash: joined correctly either way
    cfg = _cfg(tmp_path, "local", "trainer.total_training_steps=3", "trainer.checkpoint.save_freq=2",
               f"trainer.default_hdfs_dir={remote}")
    _fit(cfg, crash_at=3)
    assert (tmp_path / "remote" / "global_step_2" / "checkpoint.json").is_file()
    shutil.rmtree(tmp_path / "local")  # the node is gone; only the mirror is left

    resumed = _fit(cfg)
    assert [m["training/global_step"] for m in resumed] == [3]
    assert (tmp_path / "local" / "global_step_2" / "checkpoint.json").is_file()  # downloaded, then loaded
    assert (tmp_path / "remote" / "global_step_3" / "checkpoint.json").is_file()

    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(tmp_path / "local"), "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    saved = _tensors(tmp_path / "local" / "global_step_3", "actor")
    exported = model.state_dict()
    names = [k.removeprefix("model/") for k in saved if k.startswith("model/")]
    assert names and set(names) <= set(exported)
    for name in names:
        assert torch.equal(exported[name], saved[f"model/{name}"]), name
    ids = torch.tensor([[1, 5, 7, 9]])
    assert model.generate(ids, max_new_tokens=4, do_sample=False).shape == (1, 8)


def test_finished_run_trains_nothing_unless_resume_disabled(tmp_path: Path) -> None:
    one_step = ("trainer.total_training_steps=1", "trainer.checkpoint.async_save=false")
    assert len(_fit(_cfg(tmp_path, "c", *one_step, "trainer.checkpoint.save_freq=1"))) == 1
    assert _fit(_cfg(tmp_path, "c", *one_step, "trainer.checkpoint.save_freq=1")) == []  # resumed at the end
    again = _fit(_cfg(tmp_path, "c", *one_step, "trainer.resume_mode=disable", "trainer.checkpoint.save_freq=0"))
    assert [m["training/global_step"] for m in again] == [1]
