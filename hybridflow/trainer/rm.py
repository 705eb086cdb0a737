"""Reward-model training: `RewardModelAlgorithm`, run as `RMTrainer(cfg).fit()` — Bradley-Terry on (prompt,
chosen, rejected) pairs.

loss = -log σ(r_chosen - r_rejected - margin), where r is the scalar head at the last response position —
exactly how `RewardModelWorker` scores responses during PPO. The model is the critic-style scalar head on a
backbone from `rm.init_from` (an SFT export, any local causal LM, or a classifier checkpoint), else
`model.path` / `model.preset`. Pairs come from parquet (`data.train_files`) or, for a built-in `data.task`,
from `synthetic_pairs`. Validation: `val/loss`, `val/accuracy` (r_chosen > r_rejected), `val/reward_margin`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from hybridflow.config import Config
from hybridflow.config.schema import RMConfig
from hybridflow.data import PreferenceDataset, task_splits
from hybridflow.data.synthetic_pairs import preference_rows
from hybridflow.engine import EngineSpec, HeadRequest
from hybridflow.protocol import DataProto
from hybridflow.trainer.supervised import SupervisedAlgorithm, SupervisedTrainer
from hybridflow.workers.engine_specs import VALUES, rm_spec
from hybridflow.workers.supervised_batch import collate_pairs
from hybridflow.workers.supervised_losses import bradley_terry

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hybridflow.tracking import Tracker

logger = logging.getLogger(__name__)


def rm_model_config(cfg: Config) -> Config:
    """`rm.init_from` replaces `model.path` (so the tokenizer comes from the same directory)."""
    if not cfg.rm.init_from:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=cfg.rm.init_from))


def build_preference_datasets(cfg: Config, tokenizer: PreTrainedTokenizerBase, mix: dict[str, float] | None = None,
                              command: str = "rm") -> tuple[Dataset, Dataset | None]:
    """(train, val) `PreferenceDataset`s from parquet files, or synthetic pairs of the built-in `data.task` with the
    rejected kinds weighted by `mix` (None or {}: the task's default). `command` ("rm" / "dpo") names the datasets
    (`<command>-train`, `<command>-val`) in their errors and skip reports."""

    d = cfg.data
    kwargs = dict(max_length=d.max_prompt_length + d.max_response_length, prompt_key=d.prompt_key,
                  chosen_key=d.chosen_key, rejected_key=d.rejected_key, chat_template=d.chat_template, strict=d.strict)
    train_name, val_name = f"{command}-train", f"{command}-val"
    if d.train_files:
        train = PreferenceDataset.from_files(d.train_files, tokenizer, name=train_name, **kwargs)
        val = PreferenceDataset.from_files(d.val_files, tokenizer, name=val_name, **kwargs) if d.val_files else None
        return train, val
    if not d.task:
        raise ValueError(f"hybridflow {command}: data.train_files is empty and data.task is not set: give "
                         "prompt/chosen/rejected parquet")
    train_rows, val_rows = task_splits(d.task, d.train_size, d.val_size, d.seed)
    mix = mix or None
    train = PreferenceDataset(preference_rows(train_rows, d.seed, mix), tokenizer, name=train_name, **kwargs)
    val = PreferenceDataset(preference_rows(val_rows, d.seed + 1, mix), tokenizer, name=val_name, **kwargs)
    return train, val


class RewardModelAlgorithm(SupervisedAlgorithm):
    section, loss = "rm", "bradley_terry"
    sec: RMConfig

    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        return build_preference_datasets(self.cfg, self.tokenizer, self.sec.synthetic_mix)

    def collate_fn(self) -> Callable[[list[Any]], DataProto]:
        return functools.partial(collate_pairs, pad_token_id=self.pad_id)

    def engine_spec(self) -> EngineSpec:
        return rm_spec(self.cfg, self.total_steps, self.model_path())

    def train_head(self) -> HeadRequest:
        return VALUES

    def loss_kwargs(self) -> dict[str, Any]:
        return {"margin": self.sec.margin}

    def run(self, step: int) -> dict[str, float]:
        loader = self.make_loader(self.val_ds, shuffle=False, drop_last=False)
        chosen, rejected = [], []
        for batch in loader:
            scores = self.group.eval_scores(batch).batch["scores"]
            chosen.append(scores[0::2])
            rejected.append(scores[1::2])
        r_c, r_r = torch.cat(chosen).double(), torch.cat(rejected).double()
        diff = r_c - r_r
        return {"val/loss": float(bradley_terry(r_c, r_r, self.sec.margin).mean()),
                "val/accuracy": float((diff > 0).double().mean()), "val/reward_margin": float(diff.mean()),
                "val/chosen_reward": float(r_c.mean()), "val/rejected_reward": float(r_r.mean())}


class RMTrainer(SupervisedTrainer):
    algorithm_cls = RewardModelAlgorithm
    algorithm: RewardModelAlgorithm

    def __init__(self, cfg: Config, *, tokenizer: PreTrainedTokenizerBase | None = None,
                 tracker: Tracker | None = None) -> None:
        super().__init__(rm_model_config(cfg), tokenizer=tokenizer, tracker=tracker)
