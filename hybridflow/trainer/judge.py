"""`Judge`: the model behind LLM-as-judge rewards (`reward.sources` entry `judge`; text side: rewards/judge.py).

Placement: like the rule scorers, the judge sits on the driver's reward path, handed to the reward manager: a
second, frozen weight set loaded once (on the first GPU when there is one, beside the workers of the local backend;
else on the CPU) that generates through our rollout engine, `reward.judge.batch_size` prompts per call. Decision:
the judge reads text, not the policy's token ids, so it may use another tokenizer than the policy.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridflow.models.loader import load_module, load_tokenizer
from hybridflow.protocol import DataProto, keys
from hybridflow.rewards.judge import ERROR, OK, Verdicts, build_parser, read_verdicts, render
from hybridflow.rollout import build_rollout
from hybridflow.rollout.sampling import SamplingParams

logger = logging.getLogger(__name__)


def build_judge(reward_cfg: Any) -> Judge | None:
    """The judge when `reward.sources` names `judge`, else None."""
    return Judge(reward_cfg.judge) if any(s.name == "judge" for s in reward_cfg.sources) else None


@dataclass(frozen=True)
class _ModelSource:
    """The `model.*`-shaped keys `load_module` / `load_tokenizer` read, for the judge's directory."""

    path: str
    preset: str = "tiny"
    tokenizer_path: str | None = None
    trust_remote_code: bool = False
    override_config: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


@dataclass(frozen=True)
class _EngineSettings:
    """The rollout keys the engine reads: eager (no CUDA graphs: the judge may run beside other work), one KV cache
    sized for exactly one batch of judge prompts, freed after each call."""

    max_num_seqs: int
    kv_cache_tokens: int
    max_num_batched_tokens: int
    name: str = "hybrid"
    enforce_eager: bool = True
    free_cache_engine: bool = True
    gpu_memory_utilization: float = 0.5
    tensor_model_parallel_size: int = 1
    quantization: str = "none"  # the judge generates in its own dtype


class Judge:
    """`judge(prompts, responses, ground_truths) -> Verdicts`; the model is loaded once, frozen."""

    def __init__(self, cfg: Any, device: torch.device | str | None = None) -> None:
        self.cfg = cfg
        self.parse = build_parser(cfg.verdict_regex, cfg.verdict_fn)
        source = _ModelSource(cfg.path)
        self.tokenizer = load_tokenizer(source)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.model = load_module(source, "lm", dtype=dtype).to(self.device).eval().requires_grad_(False)
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        if eos is None:
            raise ValueError(f"reward.judge.path={cfg.path!r}: its tokenizer has no eos_token; the judge could not "
                             "end its verdict: set eos_token in its tokenizer_config.json")
        P, R = cfg.max_prompt_length, cfg.max_new_tokens
        settings = _EngineSettings(max_num_seqs=cfg.batch_size, kv_cache_tokens=cfg.batch_size * (P + R),
                                   max_num_batched_tokens=max(cfg.batch_size * P, P + R))
        self.engine = build_rollout(self.model, settings, eos_token_id=eos, pad_token_id=eos if pad is None else pad,
                                    max_prompt_length=P, max_response_length=R, device=self.device)
        self.sampling = SamplingParams(do_sample=cfg.temperature > 0, temperature=cfg.temperature or 1.0,
                                       max_new_tokens=R)

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], ground_truths: Sequence[Any]) -> Verdicts:
        texts = [render(self.cfg.template, p, r, t) for p, r, t in zip(prompts, responses, ground_truths)]
        ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        status = np.array([OK if len(row) <= self.cfg.max_prompt_length else ERROR for row in ids], dtype=object)
        if (status == ERROR).any():
            longest = max(len(row) for row in ids)
            logger.warning("%d judge prompt(s) longer than reward.judge.max_prompt_length=%d tokens (longest %d) "
                           "scored reward.judge.fallback_score; raise it or shorten reward.judge.template",
                           int((status == ERROR).sum()), self.cfg.max_prompt_length, longest)
        verdicts = [""] * len(texts)
        todo = [i for i in range(len(texts)) if status[i] == OK]
        for start in range(0, len(todo), self.cfg.batch_size):
            rows = todo[start:start + self.cfg.batch_size]
            for i, text in zip(rows, self.generate([ids[i] for i in rows])):
                verdicts[i] = text
        return read_verdicts(verdicts, self.parse, self.cfg.fallback_score, status)

    def generate(self, rows: list[list[int]]) -> list[str]:
        """One engine call for these judge prompts (left-padded) → each one's generated text."""
        width = max(len(r) for r in rows)
        pad = self.engine.pad_id
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.long)
        with torch.no_grad():
            out = self.engine.generate(DataProto.from_dict(tensors={keys.INPUT_IDS: ids, keys.ATTENTION_MASK: mask}),
                                       self.sampling)
        tokens, lengths = out.batch[keys.RESPONSES].cpu(), out.batch[keys.RESPONSE_MASK].sum(-1).tolist()
        return [self.tokenizer.decode(tokens[i, :n].tolist(), skip_special_tokens=True)
                for i, n in enumerate(lengths)]

    def close(self) -> None:
        self.engine.close()
