"""Multi-turn rollouts run `Scheduler`'s decode loop, so the hang watchdog sees a beat per decode chunk (a long
rollout with tool calls is progress, not a hang), as it does for single-turn ones."""

from __future__ import annotations

from rollout_helpers import make_model, make_prompts
from test_multi_turn import _engine

from hybridflow.utils.progress import PROGRESS


def test_multi_turn_generation_beats_once_per_decode_chunk() -> None:
    model = make_model("tiny")
    engine = _engine(model, R=24, turns=2)
    before = PROGRESS.beats
    out = engine.generate(make_prompts(2, 12, model.config.vocab_size, meta={"n": 2}))
    m = out.meta_info["metrics"]
    assert m["num_turns/max"] > 1, m  # tools were called: the multi-turn scheduler ran
    chunks = m["rollout/decode_steps"] / engine.check_every
    assert PROGRESS.beats - before >= chunks > 0, (PROGRESS.beats - before, m)
