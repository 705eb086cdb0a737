"""`PreferenceDataset`: (prompt, chosen, rejected) rows for reward-model and DPO training.

Columns and row layouts (TRL / verl / OpenRLHF names, text or messages, prompt repeated inside chosen/rejected or
implicit): `preference_columns.py`. Each pair is rendered as
prompt-with-generation-prompt + response + EOS, so the reward model scores the EOS position (the last real token
of each right-padded row: `attention_mask.sum(-1) - 1`). Over-long sequences keep their last `max_length` tokens
so the scored end survives.

Rows are checked at load, as RL prompts are (`data/contract.py`): a pair that cannot teach a preference (null,
empty or identical chosen/rejected, or malformed) is skipped and counted by reason in `self.skips` — reported by
the trainer as one `data_skipped` event and `data/skipped_rows` — or, with `data.strict=true`, is an error naming
the row.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from hybridflow.data.collate import collate_preference
from hybridflow.data.contract import SkipReport
from hybridflow.data.parquet_io import read_rows
from hybridflow.data.preference_columns import resolve_columns, skip_reason, split_row
from hybridflow.data.templates import MalformedRow, encode, render
from hybridflow.protocol import DataProto
from hybridflow.utils.tokenizer_protocol import Tokenizer

logger = logging.getLogger(__name__)


class PreferenceDataset(Dataset):
    """`__getitem__` → {chosen_input_ids, rejected_input_ids} (unpadded; see `collate_preference`)."""

    def __init__(self, rows: Sequence[dict[str, Any]], tokenizer: Tokenizer, *, max_length: int,
                 prompt_key: str = "prompt", chosen_key: str = "chosen", rejected_key: str = "rejected",
                 chat_template: str | None = None, strict: bool = False, name: str = "preference") -> None:
        self.tokenizer, self.max_length, self.chat_template = tokenizer, max_length, chat_template
        if not rows:
            raise ValueError(f"{name} dataset has no rows")
        self.columns = resolve_columns(list(rows[0]), prompt_key, chosen_key, rejected_key, name)
        self.skips = SkipReport(name, rows_read=len(rows))
        # (source row index, prompt text, chosen, rejected); an implicit text prompt is "" and the full texts are
        # kept: collation cuts their shared token prefix off as the prompt
        self.texts: list[tuple[int, str, str, str]] = self._parse(rows, strict)
        if not self.texts:
            raise ValueError(f"{name} dataset is empty after validation ({self.skips.summary()}); check the files")

    def _parse(self, rows: Sequence[dict[str, Any]], strict: bool) -> list[tuple[int, str, str, str]]:
        out, first = [], {}
        for i, row in enumerate(rows):
            try:
                prompt, chosen, rejected = split_row(row, self.columns)
            except MalformedRow as err:
                reason = skip_reason(err)
                if strict:
                    raise ValueError(f"{self.skips.name} data row {i} cannot be trained on ({reason}): {err}. Fix "
                                     "the row, or set data.strict=false to skip and count such rows") from err
                self.skips.add(reason, i)
                first.setdefault(reason, f"row {i}: {err}")
                continue
            text = "" if prompt is None else render(self.tokenizer, prompt, self.chat_template)
            out.append((i, text, chosen, rejected))
        if self.skips.total:
            logger.warning("%s. First of each: %s", self.skips.summary(), "; ".join(first.values()))
        return out

    @classmethod
    def from_files(cls, files: str | Sequence[str], tokenizer: Tokenizer, **kwargs: Any) -> PreferenceDataset:
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
        index, prompt, chosen, rejected = self.texts[i]
        return {"chosen_input_ids": self._encode(prompt, chosen),
                "rejected_input_ids": self._encode(prompt, rejected), "index": index}
