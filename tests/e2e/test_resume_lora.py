"""LoRA end to end on CPU (tiny model, local backend, GRPO with a KL loss so the adapters-off reference runs): a
run of 4 steps equals 2 steps + crash + resume + 2 steps bit-exactly, checkpoints hold adapters + their Adam
state only, and `hybridflow export` writes a PEFT adapter dir (PeftModel.from_pretrained: same logits as the merged
export) and, with --merge, base + adapters."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from peft import PeftModel
from ppo_testlib import tiny_ppo_config
from test_resume import _deterministic, _fit, _tensors
from transformers import AutoModelForCausalLM

from hybridflow.cli import main
from hybridflow.engine.lora import merge_adapters
from hybridflow.models.loader import load_module

LORA = ("model.lora.rank=4", "model.lora.alpha=8", "actor.optim.lr=2e-2", "actor.use_kl_loss=true",
        "trainer.total_training_steps=4", "trainer.checkpoint.save_freq=2")


def test_lora_resume_is_bit_exact_and_exports(tmp_path: Path) -> None:
    straight = _fit(tiny_ppo_config(tmp_path, tmp_path / "a", 1, "trainer.resume_mode=auto", *LORA,
                                    "trainer.checkpoint.async_save=false"))
    cfg = tiny_ppo_config(tmp_path, tmp_path / "b", 1, "trainer.resume_mode=auto", *LORA)
    crashed = _fit(cfg, crash_at=3)
    resumed = _fit(cfg)
    assert [m["training/global_step"] for m in crashed + resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, crashed + resumed):
        assert _deterministic(a) == _deterministic(b), a["training/global_step"]
    assert straight[-1]["actor/kl_loss"] != 0  # the adapters moved the policy away from the reference

    a, b = _tensors(tmp_path / "a" / "global_step_4", "actor"), _tensors(tmp_path / "b" / "global_step_4", "actor")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    model_keys = [k for k in a if k.startswith("model/")]
    assert model_keys and all(".lora_A." in k or ".lora_B." in k for k in model_keys)  # no base weights saved
    assert not any("base_layer" in k or "embed_tokens" in k for k in a)

    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    assert main(["export", "--checkpoint", str(tmp_path / "a"), "--out", str(adapter_dir)]) == 0
    assert main(["export", "--checkpoint", str(tmp_path / "a"), "--out", str(merged_dir), "--merge"]) == 0
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == 4

    base = load_module(cfg.model, "lm").eval()
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    peft_model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    ids = torch.tensor([[5, 9, 13, 21, 7, 3, 11, 30]])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, merged(input_ids=ids).logits,
                                   atol=1e-5, rtol=0)
    adapters = {k.removeprefix("model/"): v for k, v in a.items() if k.startswith("model/")}
    expected = merge_adapters(base_state, adapters, 8 / 4)  # W + (alpha/r)·B·A
    exported = merged.state_dict()
    for name, value in expected.items():
        assert torch.equal(exported[name], value), name
    changed = [n for n in expected if not torch.equal(expected[n], base_state[n])]
    assert changed and all(n.endswith("_proj.weight") for n in changed)
