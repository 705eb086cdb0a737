"""Build the datasets a run needs from `DataConfig`: parquet files when given, else the built-in `data.task`."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hybridflow.data.contract import ground_truth_required
from hybridflow.data.rl_dataset import RLHFDataset
from hybridflow.data.sft_dataset import SFTDataset
from hybridflow.data.tasks import get_task, task_splits
from hybridflow.protocol import keys
from hybridflow.utils.tokenizer_protocol import Tokenizer

if TYPE_CHECKING:
    from hybridflow.config.schema import DataConfig, RewardConfig


def off_by_one(row: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The default flawed demonstration: the answer one too high ("#### <answer+1>"); non-numeric answers stay."""
    truth = str(row[keys.REWARD_MODEL]["ground_truth"])
    return {**row, "response": f"#### {int(truth) + 1}"} if truth.isdigit() else row


def noisy_sft_rows(rows: list[dict], share: float, seed: int,
                   corrupt: Callable[[dict[str, Any], random.Random], dict[str, Any]] = off_by_one) -> list[dict]:
    """Copy of `rows` where a seeded `share` become flawed demonstrations (`corrupt`; by default the systematic
    near miss "#### <answer+1>").

    Used by the quickstart: supervised data with a systematic error teaches the model a wrong favourite answer
    next to the right one, which RL with the true reward can then correct — a small, fast picture of RL fixing
    what imperfect demonstrations taught. `tool_calculator` corrupts its tool calls instead (`data/tool_task.py`).
    """
    if not share:
        return rows
    rng = random.Random(seed * 7_919 + 17)
    return [corrupt(row, rng) if rng.random() < share else row for row in rows]


def _rows(data_cfg: DataConfig) -> tuple[list[dict] | None, list[dict] | None]:
    """Rows of the built-in task, or (None, None) when parquet files are configured."""
    if data_cfg.train_files:
        return None, None
    if not data_cfg.task:
        raise ValueError("data.train_files is empty and data.task is not set; give one of them")
    return task_splits(data_cfg.task, data_cfg.train_size, data_cfg.val_size, data_cfg.seed)


def build_rl_datasets(data_cfg: DataConfig, tokenizer: Tokenizer, reward_cfg: RewardConfig | None = None,
                      tools: list[dict] | None = None, image_processor: Any | None = None
                      ) -> tuple[RLHFDataset, RLHFDataset | None]:
    """(train, val) prompt datasets; val is None when parquet training files come without data.val_files.
    Ground truth is required unless `reward_cfg` scores with the reward model only or the data config opts out.
    `tools`: tool schemas rendered into the prompts by the chat template (`agentic.prompting.prompt_tools`).
    `image_processor`: a vision-language model's (`models.loader.load_image_processor`); rows may then carry images."""
    require = (ground_truth_required(data_cfg, reward_cfg) if reward_cfg is not None
               else not data_cfg.allow_missing_ground_truth)
    kwargs = dict(max_prompt_length=data_cfg.max_prompt_length, truncation=data_cfg.truncation,
                  prompt_key=data_cfg.prompt_key, strict=data_cfg.strict, chat_template=data_cfg.chat_template,
                  require_ground_truth=require, tools=tools, image_processor=image_processor)
    train_rows, val_rows = _rows(data_cfg)
    if train_rows is not None:
        val = RLHFDataset(val_rows, tokenizer, name="val", **kwargs) if val_rows else None
        return RLHFDataset(train_rows, tokenizer, name="train", **kwargs), val
    train = RLHFDataset.from_files(data_cfg.train_files, tokenizer, name="train", **kwargs)
    val = RLHFDataset.from_files(data_cfg.val_files, tokenizer, name="val", **kwargs) if data_cfg.val_files else None
    return train, val


def build_sft_datasets(data_cfg: DataConfig, tokenizer: Tokenizer, max_length: int | None = None,
                       label_noise: float = 0.0, image_processor: Any | None = None
                       ) -> tuple[SFTDataset, SFTDataset | None]:
    """(train, val) SFT datasets from the same files/task; max_length defaults to prompt + response length.
    `label_noise` (built-in tasks only) corrupts that share of the training answers, see `noisy_sft_rows`.
    `image_processor`: a vision-language model's; rows may then carry images."""
    kwargs = dict(max_length=max_length or data_cfg.max_prompt_length + data_cfg.max_response_length,
                  prompt_key=data_cfg.prompt_key, strict=data_cfg.strict, chat_template=data_cfg.chat_template,
                  image_processor=image_processor)
    train_rows, val_rows = _rows(data_cfg)
    if label_noise and train_rows is None:
        raise ValueError(f"sft.label_noise={label_noise} applies to built-in tasks only (data.task); "
                         "set it to 0 for parquet data")
    if train_rows is not None:
        corrupt = get_task(data_cfg.task).corrupt or off_by_one
        train_rows = noisy_sft_rows(train_rows, label_noise, data_cfg.seed, corrupt)
        val = SFTDataset(val_rows, tokenizer, name="sft-val", **kwargs) if val_rows else None
        return SFTDataset(train_rows, tokenizer, name="sft-train", **kwargs), val
    train = SFTDataset.from_files(data_cfg.train_files, tokenizer, name="sft-train", **kwargs)
    val = SFTDataset.from_files(data_cfg.val_files, tokenizer, name="sft-val", **kwargs) if data_cfg.val_files else None
    return train, val
