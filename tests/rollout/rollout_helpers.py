"""Builders for rollout tests: tiny random Llama-family models with peaky logits, prompt batches, engines."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Phi3Config

from hybridflow.config import load_config
from hybridflow.models.presets import preset_config
from hybridflow.protocol import DataProto
from hybridflow.rollout import RolloutEngine
from hybridflow.utils import triton_util

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
# Can a Triton kernel run in this process: on a GPU, or when triton was imported in interpreter mode (the subprocess
# that `rerun_under_triton_interpreter` starts)?
KERNEL_HERE = CUDA or triton_util.INTERPRETED
needs_kernel = pytest.mark.skipif(not KERNEL_HERE, reason="no GPU and triton is compiled-mode here: covered by "
                                  "test_kernel_under_interpreter (subprocess with TRITON_INTERPRET=1)")

PAD, EOS = 0, 1  # built-in tokenizer: <|pad|>=0, <|endoftext|>=1


def make_model(kind: str = "tiny", seed: int = 0) -> torch.nn.Module:
    """`tiny` preset, `qwen` = small Qwen2 shape (tied embeddings, GQA 8/2, 3 layers, vocab 300), or `phi3`."""
    torch.manual_seed(seed)
    if kind == "tiny":
        cfg = preset_config("tiny")
    elif kind == "phi3":  # the `qwen` shape in a module with fused qkv_proj / gate_up_proj
        cfg = Phi3Config(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
                         sliding_window=4096, pad_token_id=PAD, bos_token_id=2, eos_token_id=EOS)
    else:
        cfg = preset_config("qwen2.5-0.5b", vocab_size=300, hidden_size=128, intermediate_size=256,
                            num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2)
    cfg.initializer_range = 0.2  # peaky logits: greedy ties and near-uniform sampling would test little
    return AutoModelForCausalLM.from_config(cfg).eval()


def rollout_cfg(**kw):
    base = load_config([], []).rollout
    return dataclasses.replace(base, **kw)


def make_engine(model, max_prompt_length: int = 12, max_response_length: int = 10, **cfg_kw) -> RolloutEngine:
    cfg_kw.setdefault("free_cache_engine", False)
    return RolloutEngine(model, rollout_cfg(**cfg_kw), eos_token_id=EOS, pad_token_id=PAD,
                         max_prompt_length=max_prompt_length, max_response_length=max_response_length)


def make_prompts(B: int, P: int, vocab: int, seed: int = 0, meta: dict | None = None) -> DataProto:
    """Left-padded prompts of lengths spread over [2, P]; no special tokens inside."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P), generator=g)
    lengths = torch.randint(2, P + 1, (B,), generator=g)
    lengths[0] = P
    mask = (torch.arange(P)[None] >= (P - lengths)[:, None]).long()
    ids[mask == 0] = PAD
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_single_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                                      meta_info=dict(meta or {}))


def rerun_under_triton_interpreter(test_file: str, *pytest_args: str) -> None:
    """Run `test_file` (and `pytest_args`, e.g. `-k name`) in a fresh pytest process with TRITON_INTERPRET=1 and fail
    with its output unless it passed. Triton fixes interpreted-vs-compiled mode when first imported, which
    torch >= 2.13 does with torch itself."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", test_file, *pytest_args, "-q", "-p", "no:cacheprovider", "--noconftest"]
    r = subprocess.run(cmd, env=env, cwd=Path(test_file).resolve().parents[2], capture_output=True, text=True,
                       timeout=600)
    tail = r.stdout[-4000:] + r.stderr[-2000:]
    assert r.returncode == 0 and " passed" in tail and "failed" not in tail, tail


def assert_greedy_equals_hf(model, prompts: DataProto, out: DataProto, R: int) -> None:
    """The engine's greedy responses are HF generate's tokens, then padding."""
    P = prompts.batch["input_ids"].shape[1]
    with torch.no_grad():
        ref = model.generate(input_ids=prompts.batch["input_ids"], attention_mask=prompts.batch["attention_mask"],
                             max_new_tokens=R, do_sample=False, pad_token_id=PAD, eos_token_id=EOS)[:, P:]
    got = out.batch["responses"]
    assert torch.equal(got[:, : ref.shape[1]], ref), (got, ref)
    assert (got[:, ref.shape[1]:] == PAD).all()
