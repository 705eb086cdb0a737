"""`config validate` checks what one command uses (`--for`, or the sections set): SFT/DPO files need no scorer,
wrong columns fail naming the accepted ones (schema only), the step plan is printed; a code reward without a
sandbox and a checkpoint mirror without its fsspec backend fail before a run."""

from __future__ import annotations

import pytest
import yaml

from hybridflow.cli import main
from hybridflow.config import load_config
from hybridflow.config.plan import step_plan
from hybridflow.data.parquet_io import write_rows


def _prompts(n: int, key: str = "prompt") -> list[dict]:
    return [{key: [{"role": "user", "content": f"What is {i}+1?"}], "data_source": "openai/gsm8k",
             "reward_model": {"ground_truth": str(i + 1)}} for i in range(n)]


def test_sft_and_dpo_files_without_data_source_are_valid_for_their_command(tmp_path, capsys) -> None:
    sft = write_rows([{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(900)], tmp_path / "sft.parquet")
    pairs = write_rows([{"prompt": f"q{i}", "chosen": "a", "rejected": "b"} for i in range(64)], tmp_path / "p.parquet")
    assert main(["config", "validate", f"data.train_files=[{sft}]", "sft.total_steps=30"]) == 0
    assert "valid for `hybridflow sft`: 30 steps = 1.07 epochs of 900 rows at 32 sequences a step" in \
        capsys.readouterr().out
    cfg_file = tmp_path / "dpo.yaml"
    cfg_file.write_text(yaml.safe_dump({"data": {"train_files": [str(pairs)]}, "dpo": {"beta": 0.2}}))
    assert main(["config", "validate", str(cfg_file)]) == 0
    assert "valid for `hybridflow dpo`: 2 steps = 1.00 epochs of 64 rows at 32 pairs a step" in capsys.readouterr().out
    assert main(["config", "validate", "--for", "rm", f"data.train_files=[{pairs}]"]) == 0


@pytest.mark.parametrize("command, expected", [
    ("train", "no prompt column 'prompt': set data.prompt_key=question"),
    ("sft", "`prompt` + `completion` (TRL)"),
    ("dpo", "no chosen column 'chosen'"),
])
def test_wrong_columns_fail_with_the_accepted_ones(tmp_path, capsys, command, expected) -> None:
    bad = write_rows(_prompts(8, key="question"), tmp_path / "q.parquet")
    assert main(["config", "validate", "--for", command, f"data.train_files=[{bad}]"]) == 2
    err = capsys.readouterr().err
    assert expected in err and "data.train_files" in err and "question" in err


def test_step_plan_rule() -> None:
    cfg = load_config([], ["trainer.total_training_steps=30"], validate=False)
    assert step_plan(cfg, 900) == (30, pytest.approx(30 / 28),
                                   "30 steps = 1.07 epochs of 900 rows at 32 prompts a step "
                                   "(trainer.total_training_steps=30)")
    total, epochs, text = step_plan(load_config([], ["trainer.total_epochs=3"], validate=False), 900)
    assert (total, epochs) == (84, 3.0) and "trainer.total_epochs=3 x 28 batches" in text
    total, _, _ = step_plan(load_config([], ["sft.epochs=2", "sft.batch_size=10"], validate=False), 95, "sft")
    assert total == 18
    with pytest.raises(ValueError, match="data.train_batch_size=32 prompts is larger than the training set"):
        step_plan(cfg, 20)


def test_code_reward_without_a_sandbox_fails(tmp_path, capsys, monkeypatch) -> None:
    from hybridflow import sandbox

    monkeypatch.setattr(sandbox, "available", lambda mode: mode == "none")
    monkeypatch.setattr(sandbox, "unavailable_reason", lambda mode: "not here")
    data = write_rows(_prompts(32), tmp_path / "t.parquet")
    args = ["config", "validate", f"data.train_files=[{data}]", "reward.sources=[{name: code, weight: 1.0}]"]
    assert main(args) == 2
    assert "sandbox" in capsys.readouterr().err
    assert main([*args, "reward.sandbox.allow_unisolated=true"]) == 0


def test_checkpoint_mirror_needs_its_fsspec_backend(tmp_path, capsys, monkeypatch) -> None:
    import fsspec

    real = fsspec.get_filesystem_class

    def fake(protocol: str):
        if protocol == "s3":
            raise ImportError("Install s3fs to access S3")
        return real(protocol)

    monkeypatch.setattr(fsspec, "get_filesystem_class", fake)
    assert main(["config", "validate", "trainer.default_hdfs_dir=s3://bucket/ckpt"]) == 2
    err = capsys.readouterr().err
    assert "trainer.default_hdfs_dir='s3://bucket/ckpt'" in err and "s3fs" in err
    assert main(["config", "validate", f"trainer.default_hdfs_dir=file://{tmp_path}/mirror"]) == 0


def test_sft_is_not_held_to_rl_batch_arithmetic(capsys) -> None:
    bad_rl = "actor.ppo_mini_batch_size=12"  # 32 prompts / 12: an RL error, nothing SFT reads
    assert main(["config", "validate", "--for", "sft", bad_rl]) == 0
    assert main(["config", "validate", "--for", "train", bad_rl]) == 2
    assert "actor.ppo_mini_batch_size=12" in capsys.readouterr().err
    assert load_config([], [bad_rl], command="rm").actor.ppo_mini_batch_size == 12
