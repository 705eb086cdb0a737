"""Reward model: pair batches keep (chosen, rejected) together; the Bradley-Terry closure and the scores match
naive references; synthetic pairs are correct-vs-wrong; a short run learns the arithmetic preference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridflow.config import load_config
from hybridflow.data import PreferenceDataset, task_splits
from hybridflow.data.synthetic_pairs import preference_rows, sampled_preference_rows
from hybridflow.models.loader import load_model, load_tokenizer
from hybridflow.rewards.synthetic import arithmetic
from hybridflow.rewards.synthetic import sort as sort_score
from hybridflow.trainer.rm import RMTrainer
from hybridflow.workers.supervised_batch import collate_pairs, pair_halves, split_pair
from hybridflow.workers.supervised_losses import BradleyTerryLoss


def _cfg(tmp_path, *extra: str):
    return load_config([], [
        "trainer.device=cpu", "trainer.backend=local", "trainer.logger=[]", f"trainer.run_dir={tmp_path}/run",
        f"trainer.default_local_dir={tmp_path}/ckpt", "trainer.val_before_train=false",
        "trainer.resume_mode=disable", "trainer.checkpoint.save_freq=0",
        "data.train_size=64", "data.val_size=16", "rm.batch_size=8", "rm.micro_batch_size_per_gpu=2", *extra,
    ])


def test_synthetic_pairs_prefer_the_correct_answer():
    rows, _ = task_splits("arithmetic", 300, 4, seed=0)
    pairs = preference_rows(rows, seed=3)
    assert pairs == preference_rows(rows, seed=3)
    assert {p["rejected_kind"] for p in pairs} == {"near", "random", "format"}
    for p in pairs:
        truth = p["reward_model"]["ground_truth"]
        assert arithmetic("", p["chosen"], truth)["acc"] == 1.0
        assert arithmetic("", p["rejected"], truth)["acc"] == 0.0
        assert p["rejected"].startswith("#### ") == (p["rejected_kind"] != "format")
        if p["rejected_kind"] == "near":
            assert abs(int(p["rejected"][5:]) - int(truth)) in (1, 2, 10)
    only = preference_rows(rows, seed=3, mix={"format": 1.0})
    assert all(p["rejected"] == p["reward_model"]["ground_truth"] for p in only)
    with pytest.raises(ValueError, match="unknown rejected kinds"):
        preference_rows(rows, seed=3, mix={"unsorted": 1.0})
    srows, _ = task_splits("sort", 100, 4, seed=0)
    for p in preference_rows(srows, seed=1):
        truth = p["reward_model"]["ground_truth"]
        assert sort_score("", p["chosen"], truth) == 1.0 and sort_score("", p["rejected"], truth) == 0.0


def test_sampled_pairs_reject_wrong_policy_samples():
    rows, _ = task_splits("sort", 6, 2, seed=0)
    truths = [r["response"] for r in rows]
    samples = [[t, t, "#### 9 9 9 9", "", "#### 9 9 9 9"] for t in truths[:3]] + [[t] for t in truths[3:5]] + [[]]
    pairs = sampled_preference_rows(rows, samples, seed=1, max_pairs_per_prompt=2)
    assert pairs == sampled_preference_rows(rows, samples, seed=1, max_pairs_per_prompt=2)
    assert len(pairs) == 6  # two distinct wrong samples for each of the first three prompts, none for the rest
    for p in pairs:
        truth = p["reward_model"]["ground_truth"]
        assert p["rejected_kind"] == "sampled" and p["rejected"] in ("#### 9 9 9 9", "")
        assert sort_score("", p["chosen"], truth) == 1.0 and sort_score("", p["rejected"], truth) == 0.0
    # prompts whose samples are all right fall back to hand-made wrong answers when asked
    fallback = sampled_preference_rows(rows, samples, seed=1, fallback_mix={})
    assert len(fallback) == 6 and {p["rejected_kind"] for p in fallback[3:]} <= {"unsorted", "wrong_digits"}
    assert all(sort_score("", p["rejected"], p["reward_model"]["ground_truth"]) == 0.0 for p in fallback)
    with pytest.raises(ValueError, match="one list per row"):
        sampled_preference_rows(rows, samples[:2], seed=1)


def test_split_pair_and_interleaved_batch():
    assert split_pair([1, 2, 3, 4], [1, 2, 5]) == ([1, 2], [3, 4], [5])
    assert split_pair([1, 2, 3], [1, 2, 3, 4]) == ([1, 2], [3], [3, 4])  # each side keeps its last token
    with pytest.raises(ValueError, match="identical"):
        split_pair([1, 2], [1, 2])
    tok = load_tokenizer(load_config([], []).model)
    rows, _ = task_splits("arithmetic", 5, 4, seed=0)
    ds = PreferenceDataset(preference_rows(rows, 0), tok, max_length=96)
    items = [ds[i] for i in range(len(ds))]
    b = collate_pairs(items, tok.pad_token_id).batch
    assert b["pair_chosen"].tolist() == [1, 0] * len(items)
    for i, it in enumerate(items):
        for row, side in ((2 * i, "chosen"), (2 * i + 1, "rejected")):
            real = b["input_ids"][row][b["attention_mask"][row].bool()].tolist()
            assert real == it[f"{side}_input_ids"].tolist() + [tok.pad_token_id]  # + the score slot
        # Both rows of a pair share the prompt part exactly.
        R = b["responses"].shape[1]
        assert torch.equal(b["input_ids"][2 * i, :-R], b["input_ids"][2 * i + 1, :-R])
    scores = torch.arange(6.0)
    assert [t.tolist() for t in pair_halves(scores, torch.tensor([1, 0, 1, 0, 1, 0]))] == [[0, 2, 4], [1, 3, 5]]
    with pytest.raises(ValueError, match="whole"):
        pair_halves(scores, torch.tensor([0, 1, 1, 0, 1, 0]))


def test_bradley_terry_loss_matches_reference():
    torch.manual_seed(0)
    B, R = 6, 4
    values = torch.randn(B, R, requires_grad=True)
    mask = torch.ones(B, R, dtype=torch.long)
    mask[1, 2:] = 0
    mask[4, 1:] = 0
    from hybridflow.protocol import DataProto

    mb = DataProto.from_dict({"response_mask": mask, "pair_chosen": torch.tensor([1, 0] * 3)})
    # The whole mini-batch has 5 pairs on all ranks (this micro-batch holds 3 of them).
    loss, metrics = BradleyTerryLoss(margin=0.5)({"values": values}, mb, {"seq-mean-token-mean": torch.tensor(10.0)})
    last = mask.sum(-1) - 1
    r = values[torch.arange(B), last]
    expected = -F.logsigmoid(r[0::2] - r[1::2] - 0.5).sum() / 5
    assert torch.allclose(loss, expected)
    assert metrics["rm/accuracy"] == pytest.approx(float((r[0::2] > r[1::2]).float().mean()))
    loss.backward()
    assert values.grad[1, 2:].abs().sum() == 0 and values.grad[1, 1] != 0  # only the last valid position counts


def test_scores_match_naive_token_classifier(tmp_path):
    cfg = _cfg(tmp_path)
    trainer = RMTrainer(cfg)
    try:
        batch = next(iter(trainer.loader))
        scores = trainer.group.eval_scores(batch).batch["scores"]
        ref = load_model(cfg.model, "reward")  # the same seeded preset + scalar head
        b = batch.batch
        with torch.no_grad():
            logits = ref(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                         position_ids=b["position_ids"]).logits.squeeze(-1)
        # Score = the head at the sequence's last real token (before the score slot), as the engine's score head in PPO.
        last_real = b["attention_mask"].shape[1] - 1 - b["attention_mask"].flip(-1).argmax(-1) - 1
        assert (b["input_ids"][torch.arange(len(last_real)), last_real] == load_tokenizer(cfg.model).eos_token_id).all()
        assert torch.allclose(scores, logits[torch.arange(len(last_real)), last_real], atol=1e-4)
        m = trainer.group.train_batch(batch)[0]
        r_c, r_r = scores[0::2].double(), scores[1::2].double()
        assert m["loss"] == pytest.approx(float(-F.logsigmoid(r_c - r_r).mean()), rel=1e-4)
    finally:
        trainer.close()
