"""`hybridflow dpo` reports the pairs its files left out at load (one `data_skipped` event naming reasons and rows,
`data/skipped_rows` with the first step), and a file without usable columns fails naming the command and the
accepted columns — before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.config import load_config
from hybridflow.data import write_rows
from hybridflow.tracking import build_tracker
from hybridflow.trainer.dpo import DPOTrainer
from hybridflow.trainer.rm import RMTrainer


def _args(tmp: Path, *extra: str) -> list[str]:
    return ["trainer.device=cpu", "trainer.backend=local", "trainer.logger=[]", f"trainer.run_dir={tmp}/run",
            f"trainer.default_local_dir={tmp}/ckpt", "trainer.val_before_train=false", "trainer.resume_mode=disable",
            "trainer.checkpoint.save_freq=0", "trainer.test_freq=-1", "dpo.batch_size=4",
            "dpo.micro_batch_size_per_gpu=2", "dpo.total_steps=1", *extra]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_unusable_pairs_go_to_events_and_metrics(tmp_path: Path) -> None:
    good = [{"prompt": f"{a}+1?", "chosen": str(a + 1), "rejected": str(a + 2)} for a in range(8)]
    bad = [{"prompt": "2+2?", "chosen": "4", "rejected": "4"}, {"prompt": "1+1?", "chosen": "", "rejected": "3"},
           {"prompt": "1+2?", "chosen": None, "rejected": "4"}]
    write_rows([*good[:3], bad[0], *good[3:6], bad[1], bad[2], *good[6:]], tmp_path / "pairs.parquet")
    run_dir = tmp_path / "run"
    tracker = build_tracker([], run_dir)
    trainer = DPOTrainer(load_config([], _args(tmp_path, f"data.train_files=[{tmp_path / 'pairs.parquet'}]")),
                         tracker=tracker)
    try:
        trainer.fit()
    finally:
        trainer.close()
        tracker.close()
    events = [e for e in _jsonl(run_dir / "events.jsonl") if e["kind"] == "data_skipped"]
    assert len(events) == 1 and events[0]["level"] == "warning" and events[0]["skipped_rows"] == 3
    assert events[0]["dpo-train"] == {
        "rows_read": 11, "skipped": 3, "reasons": {"identical_pair": 1, "empty_response": 1, "null_response": 1},
        "example_rows": {"identical_pair": [3], "empty_response": [7], "null_response": [8]}}
    assert "dpo-train data: skipped 3 of 11 rows" in events[0]["message"]
    logged = [m["data/skipped_rows"] for m in _jsonl(run_dir / "metrics.jsonl") if "data/skipped_rows" in m]
    assert logged == [3.0]


@pytest.mark.parametrize("trainer_cls,command", [(DPOTrainer, "dpo"), (RMTrainer, "rm")])
def test_missing_columns_name_the_command_and_the_accepted_columns(tmp_path: Path, trainer_cls: type,
                                                                   command: str) -> None:
    write_rows([{"question": "2+3?", "answer": "5"}], tmp_path / "qa.parquet")
    cfg = load_config([], _args(tmp_path, f"data.train_files=[{tmp_path / 'qa.parquet'}]"))
    with pytest.raises(ValueError, match=rf"^{command}-train data: no chosen column 'chosen'.*Accepted columns "
                                         r"\(prompt: prompt, question.*chosen: chosen, chosen_response.*rejected: "):
        trainer_cls(cfg)


def test_parquet_pairs_are_validated_greedily_only_when_a_scorer_can_grade_them(tmp_path: Path) -> None:
    from hybridflow.models.tokenizer import builtin_tokenizer
    from hybridflow.trainer.dpo_validation import scored_val_prompts

    pairs = [{"prompt": "What is 01+02?", "chosen": "#### 3", "rejected": f"#### {n}", "data_source": source,
              "reward_model": {"style": "rule", "ground_truth": "3"}}
             for n, source in ((4, "hybridflow/arithmetic"), (5, "hybridflow/arithmetic"), (4, "nobody/knows"))]
    write_rows(pairs[:2], tmp_path / "scored.parquet")  # two pairs of one prompt: one prompt to answer
    write_rows(pairs, tmp_path / "unknown.parquet")
    write_rows([{k: v for k, v in p.items() if k != "data_source"} for p in pairs], tmp_path / "plain.parquet")

    def prompts(val: str, *extra: str):
        cfg = load_config([], _args(tmp_path, f"data.train_files=[{tmp_path / val}]",
                                    f"data.val_files=[{tmp_path / val}]", *extra))
        return scored_val_prompts(cfg, builtin_tokenizer())

    ds = prompts("scored.parquet")
    assert ds is not None and len(ds) == 1 and ds[0]["data_source"] == "hybridflow/arithmetic"
    assert prompts("unknown.parquet") is None  # no rule scorer for nobody/knows
    assert prompts("plain.parquet") is None  # no data_source column
    assert prompts("scored.parquet", "dpo.val_generate=false") is None
