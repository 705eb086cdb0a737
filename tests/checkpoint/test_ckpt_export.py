"""`hybridflow export` turns a checkpoint into an HF directory that generates the same greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridflow.checkpoint import CheckpointManager
from hybridflow.cli import main as cli_main
from hybridflow.config import load_config, to_dict
from hybridflow.models.loader import load_model


def test_export_generates_same_greedy_tokens(tmp_path: Path) -> None:
    cfg = load_config([], ["model.preset=tiny"])
    model = load_model(cfg.model, "actor").eval()
    with torch.no_grad():  # move away from the preset init so a silent fallback to random init would be caught
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    opt = torch.optim.AdamW(model.parameters())
    with CheckpointManager(tmp_path / "ckpt", async_save=True) as mgr:
        mgr.save(3, {"actor": {"model": model.state_dict(), "optimizer": opt.state_dict()}},
                 extra={"config": to_dict(cfg)})
    out = tmp_path / "hf"
    assert cli_main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    prompt = torch.tensor([[5, 9, 13, 2, 7]])
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=model.config.pad_token_id)
    with torch.no_grad():
        ref = model.generate(prompt, **kw)
        got = hf.generate(prompt, **kw)
    assert torch.equal(ref, got)
    assert tok.vocab_size > 0
    for name, p in model.state_dict().items():
        assert torch.equal(hf.state_dict()[name], p), name


def test_export_without_config_fails_clearly(tmp_path: Path, capsys) -> None:
    with CheckpointManager(tmp_path / "ckpt", async_save=False) as mgr:
        mgr.save(1, {"actor": {"model": {"w": torch.ones(1)}}})
    assert cli_main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 2
    assert "has no 'config'" in capsys.readouterr().err


def test_a_lora_scalar_head_model_exports_with_its_trained_head(tmp_path: Path) -> None:
    """A LoRA reward model's state (adapters + the trained `score` head) merges onto the rebuilt base and loads back
    as the scalar-head model with the trained head, not a fresh one."""
    from hybridflow.engine.checkpoint import write_hf
    from hybridflow.engine.lora import apply_lora
    from hybridflow.models.heads import scalar_head_from_pretrained

    cfg = load_config([], ["model.preset=tiny", "model.lora.rank=4", "model.lora.alpha=8"])
    model = load_model(cfg.model, "reward")
    apply_lora(model, cfg.model.lora, seed=0)
    trained = {k: v.detach() + 0.1 for k, v in model.state_dict().items() if "lora_" in k or k.startswith("score.")}
    out, kind = write_hf(trained, cfg.model, tmp_path / "rm")
    loaded = scalar_head_from_pretrained(str(out))
    arch = json.loads((out / "config.json").read_text())["architectures"]
    assert kind == "merged" and arch[0].endswith("ForTokenClassification")
    assert torch.equal(loaded.score.weight, trained["score.weight"])
