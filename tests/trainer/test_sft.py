"""SFT: the engine-layout batch keeps prompt tokens out of the loss; the engine's loss/accuracy match a naive HF
reference; a short run lowers the loss and exports an HF directory PPO can load."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from hybridflow.config import load_config
from hybridflow.data import SFTDataset, task_splits
from hybridflow.models.loader import load_model, load_tokenizer
from hybridflow.trainer.sft import SFTTrainer, run_sft
from hybridflow.workers.supervised_batch import collate_sft_rows, split_at_first_loss_token
from hybridflow.workers.supervised_losses import SFTLoss


def _cfg(tmp_path, *extra: str):
    return load_config([], [
        "trainer.device=cpu", "trainer.backend=local", "trainer.logger=[]", f"trainer.run_dir={tmp_path}/run",
        f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.val_before_train=false",
        "data.train_size=64", "data.val_size=16", "sft.batch_size=16", "sft.micro_batch_size_per_gpu=8",
        "sft.optim.lr=3e-3", "sft.optim.lr_scheduler=constant", *extra,
    ])


def _rows(n: int = 6):
    rows, _ = task_splits("arithmetic", n, 4, seed=0)
    return rows


def test_split_at_first_loss_token():
    p, r, m = split_at_first_loss_token([5, 6, 7, 8, 9], [0, 0, 1, 0, 1])
    assert (p, r, m) == ([5, 6], [7, 8, 9], [1, 0, 1])
    with pytest.raises(ValueError, match="no response tokens"):
        split_at_first_loss_token([1, 2], [0, 0])
    with pytest.raises(ValueError, match="prompt token"):
        split_at_first_loss_token([1, 2], [1, 1])


def test_batch_layout_excludes_prompt_tokens():
    tok = load_tokenizer(load_config([], []).model)
    ds = SFTDataset(_rows(), tok, max_length=96)
    items = [ds[i] for i in range(len(ds))]
    batch = collate_sft_rows(items, tok.pad_token_id).batch
    B, R = batch["responses"].shape
    P = batch["input_ids"].shape[1] - R
    for i, it in enumerate(items):
        ids, loss_mask = it["input_ids"].tolist(), it["loss_mask"].tolist()
        n_prompt = loss_mask.index(1)
        att = batch["attention_mask"][i].bool()
        # The real tokens, in order, are exactly the row; the prompt is left-padded, the response right-padded.
        assert batch["input_ids"][i][att].tolist() == ids
        assert batch["attention_mask"][i, :P].sum() == n_prompt and batch["attention_mask"][i, P - 1] == 1
        resp = batch["response_mask"][i]
        assert resp.sum() == sum(loss_mask)
        assert batch["responses"][i][resp.bool()].tolist() == [t for t, m in zip(ids, loss_mask) if m]
        # Position ids count real tokens from 0 regardless of the left padding.
        assert batch["position_ids"][i][att].tolist() == list(range(len(ids)))
    text = tok.decode(batch["responses"][0][batch["response_mask"][0].bool()])
    assert text.startswith("####") and "User" not in text


def _naive(model, batch):
    """Response-token NLL sum, token count and greedy hits from a plain HF forward over the padded batch."""
    b = batch.batch
    R = b["responses"].shape[1]
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   position_ids=b["position_ids"]).logits[:, -R - 1:-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    m = b["response_mask"].float()
    return -(logp * m).sum(), m.sum(), ((logits.argmax(-1) == b["responses"]).float() * m).sum()


def test_sft_loss_matches_naive_reference(tmp_path):
    cfg = _cfg(tmp_path, "trainer.resume_mode=disable")
    trainer = SFTTrainer(cfg)
    try:
        batch = next(iter(trainer.loader))
        model = load_model(cfg.model, "actor")  # the same seeded preset the engine starts from
        with torch.no_grad():
            nll, tokens, hits = _naive(model, batch)
        val = trainer.group.eval_lm(batch).batch
        assert torch.allclose(-val["sum_logp"].sum(), nll, rtol=1e-4)
        assert val["num_tokens"].sum() == tokens
        assert val["num_correct"].sum() == hits
        # The loss closure on the engine's log-probs = token-mean NLL; prompt tokens have no say.
        logp = torch.randn(batch.batch["responses"].shape)
        loss, _ = SFTLoss()({"log_probs": logp}, batch, {"token-mean": batch.batch["response_mask"].sum()})
        m = batch.batch["response_mask"].float()
        assert torch.allclose(loss, -(logp * m).sum() / m.sum())
        # One engine step's reported loss is the naive whole-batch token-mean NLL at the starting weights.
        metrics = trainer.group.train_batch(batch)[0]
        assert metrics["loss"] == pytest.approx(float(nll / tokens), rel=1e-4)
        with torch.no_grad():  # a naive cross-entropy that also trains on the prompt would differ
            ids = batch.batch["input_ids"]
            full = F.cross_entropy(model(input_ids=ids).logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        assert abs(float(full) - metrics["loss"]) > 0.01  # 100x the tolerance of the match above
    finally:
        trainer.close()


def test_run_sft_lowers_loss_and_exports_for_ppo(tmp_path):
    cfg = _cfg(tmp_path, "trainer.test_freq=-1")
    out = run_sft(cfg, steps=8, out_dir=tmp_path / "hf")
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    assert (out / "tokenizer.json").is_file()
    # PPO loads it through model.path, tokenizer included.
    ppo_model_cfg = dataclasses.replace(cfg.model, path=str(out))
    model = load_model(ppo_model_cfg, "actor")
    tok = load_tokenizer(ppo_model_cfg)
    text = "User: What is 85+73? Answer after ####.\nAssistant:"
    assert tok(text)["input_ids"] == load_tokenizer(cfg.model)(text)["input_ids"]  # same tokens as in SFT
    trained = dict(model.named_parameters())
    start = dict(load_model(cfg.model, "actor").named_parameters())
    assert any(not torch.equal(trained[k], start[k]) for k in start)
    # Training lowered the validation loss compared with the starting model.
    trainer = SFTTrainer(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume_mode="disable")))
    try:
        before = trainer.validate()["val/loss"]
    finally:
        trainer.close()
    ds = SFTDataset(task_splits("arithmetic", 64, 16, cfg.data.seed)[1], tok, max_length=96)
    batch = collate_sft_rows([ds[i] for i in range(len(ds))], tok.pad_token_id)
    with torch.no_grad():
        nll, tokens, _ = _naive(model, batch)
    assert float(nll / tokens) < before - 0.5, (float(nll / tokens), before)


def test_checkpoint_resume_restores_step_and_weights(tmp_path):
    cfg = _cfg(tmp_path, "sft.total_steps=2", "trainer.checkpoint.save_freq=1", "trainer.checkpoint.async_save=false",
               "trainer.test_freq=-1", "sft.batch_size=8", "sft.micro_batch_size_per_gpu=8")
    first = SFTTrainer(cfg)
    try:
        first.fit()
        batch = next(iter(first.loader))
        trained = first.group.eval_lm(batch).batch["sum_logp"]
    finally:
        first.close()
    assert (tmp_path / "ckpt" / "global_step_2").is_dir()
    resumed = SFTTrainer(dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, total_steps=3)))
    try:
        resumed._resume()
        assert resumed.global_step == 2
        assert torch.allclose(resumed.group.eval_lm(batch).batch["sum_logp"], trained)
    finally:
        resumed.close()


def test_target_val_loss_stops_early_and_a_missed_target_is_an_event(tmp_path):
    from hybridflow.tracking import Tracker

    # Reached: the first validation (every 2 steps) below an easy target ends the run well before the cap.
    cfg = _cfg(tmp_path / "easy", "sft.total_steps=40", "trainer.test_freq=2", "sft.target_val_loss=50.0")
    trainer = SFTTrainer(cfg)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    assert trainer.global_step == 2 and history[-1]["val/loss"] <= 50.0

    # Missed: the cap comes first → a warning event in events.jsonl naming the keys to change.
    cfg = _cfg(tmp_path / "hard", "sft.total_steps=3", "trainer.test_freq=2", "sft.target_val_loss=1e-6",
               "trainer.logger=[jsonl]")
    with Tracker.from_config(cfg) as tracker:
        run_sft(cfg, tracker=tracker, out_dir=tmp_path / "hf")
    events = (tmp_path / "hard" / "run" / "events.jsonl").read_text()
    assert "sft_target_missed" in events and "sft.total_steps=3" in events and "sft.target_val_loss" in events


def test_target_val_loss_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="sft.target_val_loss"):
        _cfg(tmp_path, "sft.target_val_loss=0")


def test_missed_target_runs_extra_schedules_from_the_current_model(tmp_path):
    from hybridflow.tracking import Tracker

    cfg = _cfg(tmp_path, "sft.total_steps=3", "trainer.test_freq=2", "sft.target_val_loss=1e-6",
               "sft.stop_at_target=false", "sft.extra_schedules=1", "sft.extra_schedule_steps=2",
               "trainer.logger=[jsonl]")
    with Tracker.from_config(cfg) as tracker:
        path = run_sft(cfg, tracker=tracker, out_dir=tmp_path / "hf")
    assert path == tmp_path / "hf_2" and (path / "config.json").exists()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [int(r["training/global_step"]) for r in rows if "sft/loss" in r] == [1, 2, 3, 4, 5]  # one step axis
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert kinds.count("sft_extra_schedule") == 1 and kinds.count("sft_target_missed") == 1  # warned once, at the end
    assert kinds.index("sft_extra_schedule") < kinds.index("sft_target_missed")


def test_rerun_of_a_finished_sft_trains_nothing_and_keeps_the_export(tmp_path, capsys):
    """Re-running a finished SFT (same command, checkpoints on): no step past total_steps, the exported model RL
    starts from is not rewritten, and the command says so in one line."""
    from hybridflow.cli import main

    argv = ["sft", "trainer.device=cpu", "trainer.backend=local", "trainer.logger=[]",
            f"trainer.run_dir={tmp_path}/run", f"trainer.default_local_dir={tmp_path}/ckpt",
            "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.checkpoint.async_save=false",
            "model.override_config={num_hidden_layers: 1}", "data.train_size=16", "data.val_size=4",
            "sft.total_steps=2", "sft.batch_size=8", "sft.micro_batch_size_per_gpu=8"]
    assert main(argv) == 0
    weights = tmp_path / "run" / "hf" / "model.safetensors"
    before = weights.stat().st_mtime_ns
    capsys.readouterr()
    assert main(argv) == 0
    assert "already at the last step, nothing trained" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("global_step_*")) == ["global_step_2"]
    assert weights.stat().st_mtime_ns == before
