"""`SFTDataset`: supervised fine-tuning rows with a loss mask on response tokens only.

Rows are `prompt` (messages or string) + `response` (string), or `messages` (a conversation whose assistant
turns are trained on). The response gets the tokenizer's EOS appended so the model learns to stop. `loss_mask[t]
= 1` when token t is a response token (a token the model must predict); the trainer shifts it with the labels.
Sequences longer than `max_length` are cut on the right.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from hybridflow.data.collate import collate_sft
from hybridflow.data.parquet_io import read_rows
from hybridflow.data.templates import MalformedRow, encode, parse_rows, render, to_messages
from hybridflow.protocol import DataProto

logger = logging.getLogger(__name__)


def _segments(row: dict[str, Any], prompt_key: str, tokenizer: Any,
              chat_template: str | None) -> list[tuple[str, bool]]:
    """Row → [(text, is_response)] in order."""
    eos = tokenizer.eos_token or ""
    if row.get("messages") is not None:
        messages = to_messages(row["messages"])
        if not any(m["role"] == "assistant" for m in messages):
            raise MalformedRow("messages has no assistant turn to train on")
        segs: list[tuple[str, bool]] = []
        done = ""
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prefix = render(tokenizer, messages[:i], chat_template, add_generation_prompt=True)
            full = render(tokenizer, messages[: i + 1], chat_template, add_generation_prompt=False)
            if not prefix.startswith(done) or not full.startswith(prefix):
                raise MalformedRow("the chat template does not render conversations prefix by prefix")
            # The turn as the template renders it, up to and including EOS (what generation would produce).
            turn = full[len(prefix):]
            end = turn.find(eos) + len(eos) if eos and eos in turn else len(turn)
            segs.append((prefix[len(done):], False))
            segs.append((turn[:end] if eos and eos in turn else turn + eos, True))
            done = prefix + turn[:end]
        return segs
    response = row.get("response")
    if not isinstance(response, str):
        raise MalformedRow(f"response must be a string, got {type(response).__name__}")
    prompt = render(tokenizer, to_messages(row.get(prompt_key)), chat_template)
    return [(prompt, False), (response + eos, True)]


class SFTDataset(Dataset):
    """`__getitem__` → {input_ids, loss_mask} (unpadded; see `collate_sft`)."""

    def __init__(self, rows: Sequence[dict[str, Any]], tokenizer: Any, *, max_length: int,
                 prompt_key: str = "prompt", chat_template: str | None = None, strict: bool = False,
                 name: str = "sft") -> None:
        self.tokenizer, self.max_length, self.name = tokenizer, max_length, name
        self.samples: list[list[tuple[str, bool]]] = parse_rows(
            rows, lambda row: _segments(row, prompt_key, tokenizer, chat_template), name, strict)

    @classmethod
    def from_files(cls, files: str | Sequence[str], tokenizer: Any, **kwargs: Any) -> SFTDataset:
        return cls(read_rows(files), tokenizer, **kwargs)

    def __len__(self) -> int:
        return len(self.samples)

    def collate(self, items: list[dict[str, Any]]) -> DataProto:
        return collate_sft(items, pad_token_id=self.tokenizer.pad_token_id or 0)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids: list[int] = []
        mask: list[int] = []
        for text, is_response in self.samples[i]:
            part = encode(self.tokenizer, text)
            ids += part
            mask += [int(is_response)] * len(part)
        return {"input_ids": torch.tensor(ids[: self.max_length], dtype=torch.long),
                "loss_mask": torch.tensor(mask[: self.max_length], dtype=torch.long), "index": i}
