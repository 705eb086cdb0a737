"""`SFTDataset`: supervised fine-tuning rows with a loss mask on response tokens only.

Layouts (`layouts.sft_layout`, decided once from the columns): `messages` (a conversation whose assistant turns
are trained on), prompt (messages or string) + `response` (verl) or `completion` (TRL: a string, or messages whose
assistant turns are trained on), or `text` (every token trained). The response gets the tokenizer's EOS appended so the model learns to stop. `loss_mask[t]
= 1` when token t is a response token (a token the model must predict); the trainer shifts it with the labels.
Sequences longer than `max_length` are cut on the right. With an image processor (a vision-language model) rows may
carry `images`, one per `<image>` placeholder of the untrained turns (`data.vision`); items then carry the row's image
tensors in `multi_modal_inputs`, as RL prompts do; their images are checked as RL rows' are (`data.vision`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from hybridflow.data.collate import collate_sft
from hybridflow.data.layouts import sft_layout
from hybridflow.data.parquet_io import read_rows, row_origin
from hybridflow.data.templates import MalformedRow, encode, parse_rows, render, to_messages
from hybridflow.data.vision import (
    DECODE_ERRORS,
    IMAGE_KEY,
    IMAGE_PAD,
    IMAGE_PLACEHOLDER,
    VisionPrompts,
    check_images,
)
from hybridflow.protocol import DataProto, keys
from hybridflow.utils.tokenizer_protocol import Tokenizer

logger = logging.getLogger(__name__)


def _chat_segments(messages: list[dict[str, str]], tokenizer: Tokenizer, chat_template: str | None,
                   first_trained: int = 0) -> list[tuple[str, bool]]:
    """Segments of a conversation; assistant turns from index `first_trained` on are trained."""
    eos = tokenizer.eos_token or ""
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first_trained]
    if not trained:
        raise MalformedRow("the conversation has no assistant turn to train on")
    segs: list[tuple[str, bool]] = []
    done = ""
    for i in trained:
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


def _segments(row: dict[str, Any], layout: str, prompt_key: str, tokenizer: Tokenizer,
              chat_template: str | None) -> list[tuple[str, bool]]:
    """Row → [(text, is_response)] in order."""
    eos = tokenizer.eos_token or ""
    if layout == "messages" or row.get("messages") is not None:
        return _chat_segments(to_messages(row.get("messages")), tokenizer, chat_template)
    if layout == "text":
        text = row.get("text")
        if not isinstance(text, str) or not text:
            raise MalformedRow(f"text must be a non-empty string, got {type(text).__name__}")
        return [(text + eos, True)]
    column = layout.split("+")[1]  # response | completion
    response = row.get(column)
    if column == "completion" and response is not None and not isinstance(response, str):
        prompt = to_messages(row.get(prompt_key))
        return _chat_segments(prompt + to_messages(response), tokenizer, chat_template, first_trained=len(prompt))
    if not isinstance(response, str):
        raise MalformedRow(f"{column} must be a string, got {type(response).__name__}")
    prompt = render(tokenizer, to_messages(row.get(prompt_key)), chat_template)
    return [(prompt, False), (response + eos, True)]


class SFTDataset(Dataset):
    """`__getitem__` → {input_ids, loss_mask[, multi_modal_inputs]} (unpadded; see `collate_sft`)."""

    def __init__(self, rows: Sequence[dict[str, Any]], tokenizer: Tokenizer, *, max_length: int,
                 prompt_key: str = "prompt", chat_template: str | None = None, strict: bool = False,
                 name: str = "sft", image_processor: Any | None = None,
                 sources: Sequence[tuple[str, int]] = ()) -> None:
        self.tokenizer, self.max_length, self.name = tokenizer, max_length, name
        self.sources = list(sources)  # (file, rows) each, when read from files: error messages name the file
        if not rows:
            raise ValueError(f"{name} dataset has no rows")
        self.vision = None if image_processor is None else VisionPrompts(tokenizer, image_processor)
        if self.vision is None and any(_has_images(row) for row in rows):
            raise ValueError(f"{name} rows carry images but the model takes none (no image processor): use a "
                             "vision-language model (model.preset=tiny-vl or a Qwen2.5-VL directory) or drop the "
                             "images column")
        self.layout = sft_layout(list(rows[0]), prompt_key, name)
        by_text: dict[str, list[tuple[str, bool]]] = {}  # built-in tasks repeat problems: render each text once

        def segments(row: dict[str, Any]) -> tuple[list[tuple[str, bool]], list[Any]]:
            key = repr([row.get(k) for k in ("messages", "text", "response", "completion", prompt_key)])
            if key not in by_text:  # the fields `_segments` reads
                by_text[key] = _segments(row, self.layout, prompt_key, tokenizer, chat_template)
            segs = by_text[key]
            if self.vision is None:
                return segs, []
            if any(trained and IMAGE_PLACEHOLDER in text for text, trained in segs):
                raise MalformedRow(f"a trained turn holds {IMAGE_PLACEHOLDER}: images belong to untrained turns")
            return segs, check_images(row, [{"content": text} for text, _ in segs], self.vision)

        parsed = parse_rows(list(enumerate(rows)), lambda pr: (pr[0], segments(pr[1])), name, strict,
                            lambda i: row_origin(self.sources, i))
        self.positions = [p for p, _ in parsed]  # each sample's row in `rows` (malformed rows may be skipped)
        self.samples: list[tuple[list[tuple[str, bool]], list[Any]]] = [s for _, s in parsed]
        self.image_token_id = None if self.vision is None else tokenizer.convert_tokens_to_ids(IMAGE_PAD)

    @classmethod
    def from_files(cls, files: str | Sequence[str], tokenizer: Tokenizer, **kwargs: Any) -> SFTDataset:
        sources: list[tuple[str, int]] = []
        return cls(read_rows(files, sources), tokenizer, sources=sources, **kwargs)

    def __len__(self) -> int:
        return len(self.samples)

    def collate(self, items: list[dict[str, Any]]) -> DataProto:
        return collate_sft(items, pad_token_id=self.tokenizer.pad_token_id or 0)

    def __getitem__(self, i: int) -> dict[str, Any]:
        segs, images = self.samples[i]
        where = f"{self.name} data row {self.positions[i]}{row_origin(self.sources, self.positions[i])}"
        mm: dict[str, torch.Tensor] = {}
        if images:  # each placeholder → its image's tokens, images in order across the segments
            try:
                mm, counts = self.vision.tensors(images)
            except DECODE_ERRORS as err:  # PIL cannot decode the bytes, or the image processor refuses
                raise ValueError(f"{where}: cannot read its images: {type(err).__name__}: {err}. Fix the row's "
                                 f"{IMAGE_KEY!r} column (or drop the row)") from err
            expanded = []
            for text, is_response in segs:
                n = text.count(IMAGE_PLACEHOLDER)
                expanded.append((VisionPrompts.expand(text, counts[:n]), is_response))
                counts = counts[n:]
            segs = expanded
        ids: list[int] = []
        mask: list[int] = []
        for text, is_response in segs:
            part = encode(self.tokenizer, text)
            ids += part
            mask += [int(is_response)] * len(part)
        if self.vision is not None:
            self.vision.check_inputs(mm, ids, where)
        if images and self.image_token_id in ids[self.max_length:]:
            raise ValueError(f"{where}: {len(ids)} tokens with its images > max length {self.max_length}; "
                             "the cut would drop image tokens: raise data.max_prompt_length")
        item = {keys.INPUT_IDS: torch.tensor(ids[: self.max_length], dtype=torch.long),
                "loss_mask": torch.tensor(mask[: self.max_length], dtype=torch.long), "index": i}
        return item | ({keys.MULTI_MODAL_INPUTS: mm} if self.vision is not None else {})


def _has_images(row: dict[str, Any]) -> bool:
    images = row.get(IMAGE_KEY)
    return images is not None and len(images) > 0
