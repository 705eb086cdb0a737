"""The user's path on a task of its own, through the commands a user types: verl-schema parquet + a partial-credit
`compute_score` → `config validate` → `hybridflow sft` → `hybridflow train` (GRPO from the SFT export, the reward
given by `reward.custom.path` alone) → `hybridflow export` → plain transformers (`apply_chat_template` +
`generate`) and `hybridflow generate`. At each hand-off the same greedy answers (or the same validation metrics)
come out: the export carries the `raw` chat template training used, so nothing outside hybridflow has to know it.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.cli import main
from hybridflow.config import load_config
from hybridflow.data.parquet_io import read_rows, write_rows
from hybridflow.utils.chat_template import RAW_JINJA

pytestmark = pytest.mark.slow

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Partial credit: the share of positions where the answer has the right letter."""
    answer = solution_str.strip()
    hits = sum(a == b for a, b in zip(answer, ground_truth))
    return hits / max(len(ground_truth), len(answer), 1)
'''
CONFIG = """
model: {{override_config: {{num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128}}}}
data:
  train_files: [{dir}/train.parquet]
  val_files: [{dir}/val.parquet]
  chat_template: raw
  max_prompt_length: 8
  max_response_length: 6
  train_batch_size: 8
actor: {{ppo_mini_batch_size: 8}}
rollout: {{n: 2}}
reward: {{custom: {{path: {dir}/reward.py}}}}
sft: {{total_steps: 80, batch_size: 16, micro_batch_size_per_gpu: 16, optim: {{lr: 3.0e-3}}, export_dir: {dir}/sft_hf}}
trainer:
  device: cpu
  backend: local
  logger: [jsonl]
  val_before_train: false
  total_training_steps: 2
  log_val_generations: 16
  run_dir: {dir}/run
  default_local_dir: {dir}/ckpt
  checkpoint: {{async_save: false}}
"""


def _task(tmp_path):
    """Reverse a 3-letter word ("abc" -> "cba"): verl-schema rows with a `response` column for SFT."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefgh") for _ in range(3)) for _ in range(200)]

    def rows(ws):
        return [{"data_source": "me/reverse", "prompt": [{"role": "user", "content": w}], "ability": "toy",
                 "reward_model": {"style": "rule", "ground_truth": w[::-1]}, "extra_info": {"i": i},
                 "response": w[::-1]} for i, w in enumerate(ws)]

    write_rows(rows(words[:184]), tmp_path / "train.parquet")
    write_rows(rows(words[184:]), tmp_path / "val.parquet")
    (tmp_path / "reward.py").write_text(REWARD)
    cfg = tmp_path / "task.yaml"
    cfg.write_text(CONFIG.format(dir=tmp_path))
    return cfg


def _metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _validation(cfg_file, *overrides):
    """Greedy validation answers and metrics through the trainer's own Validator (what `train`/`eval` run)."""
    from hybridflow.trainer.ppo import PPOTrainer

    trainer = PPOTrainer(load_config([cfg_file], list(overrides)))
    try:
        metrics = trainer.validator.run(step=0)
        answers = {s["prompt"]: s["response"].replace("<|endoftext|>", "") for s in trainer.validator.last_generations}
    finally:
        trainer.close()
    return answers, metrics


def test_user_path_answers_survive_every_hand_off(tmp_path, capsys):
    cfg = _task(tmp_path)
    assert main(["config", "validate", str(cfg)]) == 0

    # 1. SFT warm start on the parquet (prompt + response), exported with the raw template
    assert main(["sft", str(cfg)]) == 0
    assert (tmp_path / "ckpt" / "global_step_80").is_dir()
    sft_dir = tmp_path / "sft_hf"
    assert json.loads((sft_dir / "tokenizer_config.json").read_text())["chat_template"] == RAW_JINJA

    # 2. GRPO from the SFT export; the reward is reward.custom.path alone (no reward.sources). With the same
    # checkpoint directory as the SFT run it stops with the fix instead of loading an SFT checkpoint as PPO's; with
    # its own checkpoint directory but the SFT run's run_dir it stops instead of appending to the SFT run's metrics.
    assert main(["train", str(cfg), "--quiet-config", f"model.path={sft_dir}"]) == 2
    assert "holds a sft checkpoint (global_step_80)" in capsys.readouterr().err
    assert main(["train", str(cfg), "--quiet-config", f"model.path={sft_dir}",
                 f"trainer.default_local_dir={tmp_path}/grpo_ckpt"]) == 2
    assert "holds another run's metrics" in capsys.readouterr().err
    assert main(["train", str(cfg), "--quiet-config", f"model.path={sft_dir}",
                 f"trainer.default_local_dir={tmp_path}/grpo_ckpt", f"trainer.run_dir={tmp_path}/grpo_run"]) == 0
    history = _metrics(tmp_path / "grpo_run")
    last_val = next(m for m in reversed(history) if "val/accuracy" in m)
    assert "reward/score/mean" in history[-1] and "val/me/reverse/reward" in last_val
    assert last_val["val/accuracy"] <= last_val["val/reward"]  # partial credit is not success

    # 3. export the final checkpoint: its tokenizer carries the training template (raw)
    out = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(tmp_path / "grpo_ckpt"), "--out", str(out)]) == 0
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == RAW_JINJA

    # 4. validation of the export (no data.chat_template given: the exported tokenizer's) = training's last one
    answers, metrics = _validation(cfg, f"model.path={out}", "data.chat_template=null")
    assert metrics["val/reward"] == pytest.approx(last_val["val/reward"], abs=1e-6)
    assert metrics["val/accuracy"] == pytest.approx(last_val["val/accuracy"], abs=1e-6)
    assert len(answers) == 16

    # 5. plain transformers: apply_chat_template + greedy generate gives the validation's answers
    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    val_rows = read_rows(str(tmp_path / "val.parquet"))
    for row in val_rows:
        enc = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=True,
                                      return_tensors="pt")
        assert tok.decode(enc["input_ids"][0]) == row["prompt"][0]["content"]  # raw: the prompt as it is
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        text = tok.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        assert text == answers[row["prompt"][0]["content"]], row["prompt"]

    # 6. `hybridflow generate --validate` on the same parquet, with the exported model alone, agrees too
    gen_out = tmp_path / "generated.parquet"
    assert main(["generate", "--input", str(tmp_path / "val.parquet"), "--output", str(gen_out), "--validate",
                 f"model.path={out}", "data.max_prompt_length=8", "data.max_response_length=6"]) == 0
    generated = {r["prompt"][0]["content"]: r["responses"][0] for r in read_rows(str(gen_out))}
    assert generated == answers
