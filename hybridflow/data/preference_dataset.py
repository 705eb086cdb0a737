"""`PreferenceDataset`: (prompt, chosen, rejected) rows for reward-model and DPO training.

Columns and row layouts (TRL / verl / OpenRLHF names, text or messages, prompt repeated inside chosen/rejected or
implicit): `preference_columns.py`. Each pair is rendered as
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
from hybridflow.data.preference_columns import resolve_columns, split_row
from hybridflow.data.templates import encode, parse_rows, render
from hybridflow.protocol import DataProto

logger = logging.getLogger(__name__)


class PreferenceDataset(Dataset):
    """`__getitem__` → {chosen_input_ids, rejected_input_ids} (unpadded; see `collate_preference`)."""

    def __init__(self, rows: Sequence[dict[str, Any]], tokenizer: Any, *, max_length: int,
                 prompt_key: str = "prompt", chosen_key: str = "chosen", rejected_key: str = "rejected",
                 chat_template: str | None = None, strict: bool = False, name: str = "preference") -> None:
        self.tokenizer, self.max_length = tokenizer, max_length
        if not rows:
            raise ValueError(f"{name} dataset has no rows")
        self.columns = resolve_columns(list(rows[0]), prompt_key, chosen_key, rejected_key, name)

        def parse(row: dict[str, Any]) -> tuple[str, str, str]:
            prompt, chosen, rejected = split_row(row, self.columns)
            # implicit text prompt: the full texts; collation cuts their shared token prefix off as the prompt
            text = "" if prompt is None else render(tokenizer, prompt, chat_template)
            return text, chosen, rejected

        self.texts: list[tuple[str, str, str]] = parse_rows(rows, parse, name, strict)

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
