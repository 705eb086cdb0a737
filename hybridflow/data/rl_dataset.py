"""`RLHFDataset`: prompts for PPO/GRPO from verl-schema rows (parquet files or the built-in tasks).

Columns: `data_source` (selects the reward function), `prompt` (chat messages or a string; `data.prompt_key`),
`ability`, `reward_model` ({style, ground_truth}), `extra_info` (dict). Rows are checked up front against the data
contract (`hybridflow.data.contract`): malformed rows and empty prompts are skipped and counted in `self.skips`
(malformed ones raise with `data.strict`); an unusable ground truth raises. Over-long prompts: `error` and `filter`
are decided up front (one tokenisation pass, so training never dies mid-run); `left`/`right` truncate in
`__getitem__`, which is where tokenisation happens (in the dataloader workers). With an image processor (a
vision-language model) rows may carry `images`, one per `<image>` placeholder (`hybridflow.data.vision`); a
mismatch, an unreadable image header or a size the image processor refuses is a malformed row; bytes that do not
decode, or image tensors that do not fit the prompt, raise in `__getitem__` naming the row (and its file), in the
driver, before any worker sees the batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from hybridflow.data.collate import collate_rl
from hybridflow.data.contract import SkipReport, check_ground_truths, empty_prompt_reason
from hybridflow.data.parquet_io import read_rows, row_origin
from hybridflow.data.templates import MalformedRow, encode, render, to_messages
from hybridflow.data.vision import DECODE_ERRORS, IMAGE_KEY, VisionPrompts, check_images
from hybridflow.protocol import DataProto, keys
from hybridflow.utils.tokenizer_protocol import Tokenizer

logger = logging.getLogger(__name__)

TRUNCATION_MODES = ("error", "left", "right", "filter")


def _as_dict(value: Any, column: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise MalformedRow(f"{column} must be a dict (or missing), got {type(value).__name__}")
    return value


def normalize_row(row: dict[str, Any], prompt_key: str, position: int,
                  vision: VisionPrompts | None = None) -> dict[str, Any]:
    """A raw row → the dataset's canonical fields; raises MalformedRow naming what is wrong. `vision`: the model's
    image prompts (None: the model takes no images, and a row with images is malformed)."""
    if prompt_key not in row:
        raise MalformedRow(f"no {prompt_key!r} column (set data.prompt_key to the prompt column)")
    messages = to_messages(row[prompt_key])
    if vision is not None:
        images = check_images(row, messages, vision)
    elif row.get(IMAGE_KEY) is not None and len(row[IMAGE_KEY]):
        raise MalformedRow(f"the row has {IMAGE_KEY!r} but the model takes no images (no image processor); use a "
                           "vision-language model or drop the column")
    else:
        images = []
    data_source = row.get(keys.DATA_SOURCE, "unknown")
    if not isinstance(data_source, str):
        raise MalformedRow(f"data_source must be a string, got {type(data_source).__name__}")
    reward_model = _as_dict(row.get(keys.REWARD_MODEL), keys.REWARD_MODEL)
    return {
        "messages": messages,
        "raw_prompt": row[prompt_key],
        keys.DATA_SOURCE: data_source,
        "ability": row.get("ability") or "",
        keys.REWARD_MODEL: {"style": reward_model.get("style", "rule"), **reward_model,
                         "ground_truth": reward_model.get("ground_truth")},
        keys.EXTRA_INFO: _as_dict(row.get(keys.EXTRA_INFO), keys.EXTRA_INFO),
        "index": position,
        IMAGE_KEY: images,
    }


def validate_rows(rows: Sequence[dict[str, Any]], prompt_key: str, strict: bool, skips: SkipReport,
                  vision: VisionPrompts | None = None,
                  sources: Sequence[tuple[str, int]] = ()) -> list[dict[str, Any]]:
    """Normalise every row; malformed ones raise (strict) or are skipped, empty prompts are skipped; both are
    counted in `skips` and summarised in one warning. `sources`: the files the rows came from (`read_rows`)."""
    good, reasons = [], {}
    for i, row in enumerate(rows):
        try:
            norm = normalize_row(row, prompt_key, i, vision)
        except MalformedRow as err:
            if strict:
                raise ValueError(f"{skips.name} data row {i}{row_origin(sources, i)} is malformed: {err}. Fix the "
                                 "row, or set data.strict=false to skip malformed rows") from err
            skips.add("malformed", i)
            reasons.setdefault("malformed", f"row {i}{row_origin(sources, i)}: {err}")
            continue
        empty = empty_prompt_reason(norm["messages"])
        if empty is not None:
            skips.add("empty_prompt", i)
            reasons.setdefault("empty_prompt", f"row {i}: {empty}")
            continue
        good.append(norm)
    if skips.total:
        logger.warning("%s. First of each: %s", skips.summary(), "; ".join(reasons.values()))
    return good


class RLHFDataset(Dataset):
    """Prompt dataset; `__getitem__` renders the chat template and tokenises (unpadded `input_ids`)."""

    def __init__(self, rows: Sequence[dict[str, Any]], tokenizer: Tokenizer, *, max_prompt_length: int,
                 truncation: str = "error", prompt_key: str = "prompt", strict: bool = False,
                 chat_template: str | None = None, name: str = "train", require_ground_truth: bool = True,
                 tools: list[dict[str, Any]] | None = None, image_processor: Any | None = None,
                 sources: Sequence[tuple[str, int]] = ()) -> None:
        if truncation not in TRUNCATION_MODES:
            raise ValueError(f"data.truncation={truncation!r}: must be one of {', '.join(TRUNCATION_MODES)}")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.chat_template = chat_template
        self.tools = tools  # multi-turn: tool schemas offered through apply_chat_template(tools=...)
        self.name = name
        # image prompts → expanded ids + pixel values (vision-language models only)
        self.vision = None if image_processor is None else VisionPrompts(tokenizer, image_processor)
        self.sources = list(sources)  # (file, rows) each, when read from files: error messages name the file
        self.skips = SkipReport(name, rows_read=len(rows))
        self.rows = validate_rows(rows, prompt_key, strict, self.skips, self.vision, self.sources)
        if require_ground_truth:
            check_ground_truths(rows, self.rows, name)
        if truncation in ("error", "filter"):
            self._check_lengths()
        if not self.rows:
            raise ValueError(f"{name} dataset is empty after validation ({self.skips.summary()}); check the files")

    @classmethod
    def from_files(cls, files: str | Sequence[str], tokenizer: Tokenizer, **kwargs: Any) -> RLHFDataset:
        sources: list[tuple[str, int]] = []
        return cls(read_rows(files, sources), tokenizer, sources=sources, **kwargs)

    def _check_lengths(self) -> None:
        """One tokenisation pass: over-long prompts raise (`error`) or are dropped (`filter`); 0-token prompts
        (possible with `raw` templates) are dropped as empty. Each distinct prompt is rendered once: built-in tasks
        repeat their problems (the quickstart's 64,000 rows hold 9,744), and the template render dominates."""
        by_prompt: dict[str, int] = {}
        lengths = []
        for row in self.rows:
            counts = self.vision.token_counts(row[IMAGE_KEY]) if row[IMAGE_KEY] else []  # from image sizes
            key = repr(row["messages"]) + repr(counts)
            if key not in by_prompt:
                text = render(self.tokenizer, row["messages"], self.chat_template, tools=self.tools)
                by_prompt[key] = len(encode(self.tokenizer, self.vision.expand(text, counts) if counts else text))
            lengths.append(by_prompt[key])
        over = [i for i, n in enumerate(lengths) if n > self.max_prompt_length]
        if over and self.truncation == "error":
            i = over[0]
            raise ValueError(
                f"{self.name} data: {len(over)} prompts exceed data.max_prompt_length={self.max_prompt_length} "
                f"(first: row {self.rows[i]['index']} with {lengths[i]} tokens). Raise data.max_prompt_length, or "
                "set data.truncation to filter (drop them), left or right (cut them)")
        dropped = {i: "overlong" for i in over} | {i: "empty_prompt" for i, n in enumerate(lengths) if n == 0}
        if not dropped:
            return
        for i, reason in sorted(dropped.items()):
            self.skips.add(reason, self.rows[i]["index"])
        self.rows = [r for i, r in enumerate(self.rows) if i not in dropped]
        logger.warning("%s data: dropped %d prompts (%d longer than data.max_prompt_length=%d, %d of 0 tokens); "
                       "%d remain", self.name, len(dropped), len(over), self.max_prompt_length,
                       len(dropped) - len(over), len(self.rows))

    def _where(self, row: dict[str, Any]) -> str:
        return f"{self.name} data row {row['index']}{row_origin(self.sources, row['index'])}"

    def _encode(self, row: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
        """Prompt ids and the row's image tensors ({} without images), checked against each other."""
        text = render(self.tokenizer, row["messages"], self.chat_template, tools=self.tools)
        mm: dict[str, Any] = {}
        if row[IMAGE_KEY]:
            try:
                text, mm = self.vision(text, row[IMAGE_KEY])
            except DECODE_ERRORS as err:  # PIL cannot decode the bytes, or the image processor refuses
                raise ValueError(f"{self._where(row)}: cannot read its images: {type(err).__name__}: {err}. Fix "
                                 f"the row's {IMAGE_KEY!r} column (or drop the row)") from err
        ids = encode(self.tokenizer, text)
        if self.vision is not None:
            self.vision.check_inputs(mm, ids, self._where(row))
        return ids, mm

    def __len__(self) -> int:
        return len(self.rows)

    def collate(self, items: list[dict[str, Any]]) -> DataProto:
        """Left-pad to the longest prompt of the batch (see `collate_rl`)."""
        return collate_rl(items, pad_token_id=self.tokenizer.pad_token_id or 0)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.rows[i]
        ids, mm = self._encode(row)
        if len(ids) > self.max_prompt_length and mm:
            raise ValueError(f"{self._where(row)}: {len(ids)} prompt tokens with its images > "
                             f"data.max_prompt_length={self.max_prompt_length}; truncation would cut image tokens: "
                             "raise data.max_prompt_length")
        if len(ids) > self.max_prompt_length:
            if self.truncation == "left":
                ids = ids[-self.max_prompt_length:]
            elif self.truncation == "right":
                ids = ids[: self.max_prompt_length]
            else:  # error/filter were checked up front; a tokenizer change since then lands here
                raise ValueError(f"{self.name} row {row['index']}: {len(ids)} prompt tokens > "
                                 f"data.max_prompt_length={self.max_prompt_length}")
        return {
            keys.INPUT_IDS: torch.tensor(ids, dtype=torch.long),
            "raw_prompt": row["raw_prompt"],
            keys.DATA_SOURCE: row[keys.DATA_SOURCE],
            "ability": row["ability"],
            keys.REWARD_MODEL: row[keys.REWARD_MODEL],
            keys.EXTRA_INFO: row[keys.EXTRA_INFO],
            "index": row["index"],
            keys.UID: f"{self.name}-{row['index']}",
        } | ({keys.MULTI_MODAL_INPUTS: mm} if self.vision is not None else {})
