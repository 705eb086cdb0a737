"""`PreferenceDataset`: (prompt, chosen, rejected) rows for reward-model training.

`chosen` / `rejected` are response strings (or single assistant messages); each pair is rendered as
prompt-with-generation-prompt + response + EOS, so the reward model scores the EOS position (the last real token
of each right-padded row: `attention_mask.sum(-1) - 1`). Over-long sequences keep their last `max_length` tokens
so the scored end survives.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from hybridflow.data.collate import collate_preference
from hybridflow.data.parquet_io import read_rows
from hybridflow.data.templates import MalformedRow, encode, parse_rows, render, to_messages
from hybridflow.protocol import DataProto

logger = logging.getLogger(__name__)


def _response_text(value: Any, column: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and isinstance(value[-1], dict) and isinstance(value[-1].get("content"), str):
        return value[-1]["content"]
    raise MalformedRow(f"{column} must be a string or a list of messages, got {type(value).__name__}")


class PreferenceDataset(Dataset):
    """`__getitem__` → {chosen_input_ids, rejected_input_ids} (unpadded; see `collate_preference`)."""

    def __init__(self, rows: Sequence[dict[str, Any]], tokenizer: Any, *, max_length: int,
                 prompt_key: str = "prompt", chat_template: str | None = None, strict: bool = False,
                 name: str = "preference") -> None:
        self.tokenizer, self.max_length = tokenizer, max_length
        self.texts: list[tuple[str, str, str]] = parse_rows(rows, lambda row: (
            render(tokenizer, to_messages(row.get(prompt_key)), chat_template),
            _response_text(row.get("chosen"), "chosen"), _response_text(row.get("rejected"), "rejected"),
        ), name, strict)

    @classmethod
    def from_files(cls, files: str | Sequence[str], tokenizer: Any, **kwargs: Any) -> PreferenceDataset:
        return cls(read_rows(files), tokenizer, **kwargs)

    def __len__(self) -> int:
        return len(self.texts)

    def collate(self, items: list[dict[str, Any]]) -> DataProto:
        return collate_preference(items, pad_token_id=self.tokenizer.pad_token_id or 0)

    def _encode(self, prompt: str, response: str) -> torch.Tensor:
        eos = self.tokenizer.eos_token or ""
        ids = encode(self.tokenizer, prompt + response + eos)
        return torch.tensor(ids[-self.max_length:], dtype=torch.long)

    def __getitem__(self, i: int) -> dict[str, Any]:
        prompt, chosen, rejected = self.texts[i]
        return {"chosen_input_ids": self._encode(prompt, chosen),
                "rejected_input_ids": self._encode(prompt, rejected), "index": i}
