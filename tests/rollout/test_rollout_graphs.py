"""The CUDA-graph bookkeeping on CPU: `_capture` is replaced by a fake that runs the real warm-up steps and
records a replayable step, so lazy per-bucket capture in the middle of a generation (state snapshot/restore)
and the eager fallback are checked against plain eager decoding."""

from __future__ import annotations

import logging

import torch
from rollout_helpers import make_engine, make_model, make_prompts

from hybridflow.rollout import model_runner
from hybridflow.rollout.model_runner import ModelRunner, buckets_for, kv_buckets_for


class _FakeGraph:
    def __init__(self, fn):
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def _fake_capture(self: ModelRunner, b: int, L: int) -> None:
    for _ in range(2):  # warm-up steps run for real, exactly as on the GPU
        self._eager_step(b, L, self.mode)
    mode = self.mode
    self.graphs[(b, L, mode)] = _FakeGraph(lambda: self._eager_step(b, L, mode))


def _generate(model, prompts, graphs: bool):
    P = prompts.batch["input_ids"].shape[1]
    engine = make_engine(model, P, 12, max_num_seqs=20, stop_token_ids=[7, 8, 9, 10, 11, 12, 13])
    engine.use_graphs = graphs
    out = engine.generate(prompts)
    return out, engine._runner


def test_buckets():
    assert buckets_for(20) == [8, 16, 20] and buckets_for(8) == [8] and buckets_for(5) == [5]
    assert kv_buckets_for(1040) == [128, 192, 256, 384, 512, 768, 1024, 1040] and kv_buckets_for(64) == [64]


def test_lazy_capture_mid_generation_equals_eager(monkeypatch):
    model = make_model("qwen")
    # P=120: the attended KV length moves from 128 to all 144 columns mid-generation, so graphs differ in b and L
    prompts = make_prompts(12, 120, model.config.vocab_size, seed=7, meta={"n": 2, "seeds": list(range(12))})
    eager, _ = _generate(model, prompts, graphs=False)
    monkeypatch.setattr(ModelRunner, "_capture", _fake_capture)
    monkeypatch.setattr(model_runner, "CAPTURE_MIN_REMAINING", 0)  # capture smaller buckets as rows finish
    graphed, runner = _generate(model, prompts, graphs=True)
    keys = runner.graphs.keys()
    assert runner.use_graphs and len({b for b, _, _ in keys}) >= 2 and len({L for _, L, _ in keys}) == 2, keys
    for key in ("responses", "response_mask"):
        assert torch.equal(graphed.batch[key], eager.batch[key]), key
    torch.testing.assert_close(graphed.batch["rollout_log_probs"], eager.batch["rollout_log_probs"],
                               atol=1e-5, rtol=0)


def test_failed_capture_falls_back_to_eager(monkeypatch, caplog):
    model = make_model("tiny")
    prompts = make_prompts(5, 10, model.config.vocab_size, meta={"seeds": list(range(5))})
    eager, _ = _generate(model, prompts, graphs=False)

    def broken(self, b, L):
        self._eager_step(b, L, self.mode)  # dirties the slot state before failing: the snapshot must restore it
        raise RuntimeError("capture not permitted")

    monkeypatch.setattr(ModelRunner, "_capture", broken)
    with caplog.at_level(logging.WARNING):
        out, runner = _generate(model, prompts, graphs=True)
    assert not runner.use_graphs and "decoding eagerly" in caplog.text
    assert torch.equal(out.batch["responses"], eager.batch["responses"])
