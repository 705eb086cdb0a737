"""Padding and collation of tokenised rows into `DataProto` batches.

RL prompts are LEFT-padded to the longest prompt in the batch (generation appends on the right, so every row's
last prompt token sits in the same column); SFT and preference sequences are RIGHT-padded (training only).
`position_ids = cumsum(attention_mask) - 1`, clipped at 0, so padding never shifts real positions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hybridflow.protocol import DataProto, keys

# Non-tensor columns every RL batch carries (the trainer and the reward manager read them).
RL_NON_TENSOR_KEYS = (keys.DATA_SOURCE, keys.REWARD_MODEL, keys.EXTRA_INFO, keys.UID, "raw_prompt", "index", "ability")


def position_ids_from_mask(mask_BT: torch.Tensor) -> torch.Tensor:
    """cumsum(mask) - 1 clipped at 0: real tokens get 0, 1, 2, ... whatever padding precedes them."""
    return (mask_BT.long().cumsum(-1) - 1).clamp_(min=0)


def pad_sequences(seqs: Sequence[Sequence[int] | torch.Tensor], pad_value: int, side: str,
                  length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad 1-D token sequences to `length` (default: the longest) on `side`; returns (ids_BT, mask_BT)."""
    if side not in ("left", "right"):
        raise ValueError(f"side={side!r}: must be 'left' or 'right'")
    lens = [len(s) for s in seqs]
    width = max(lens, default=0) if length is None else length
    if lens and max(lens) > width:
        raise ValueError(f"a sequence of {max(lens)} tokens does not fit the pad length {width}")
    ids = torch.full((len(seqs), width), pad_value, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (seq, n) in enumerate(zip(seqs, lens)):
        if n == 0:
            continue
        row = torch.as_tensor(seq, dtype=torch.long)
        cols = slice(width - n, width) if side == "left" else slice(0, n)
        ids[i, cols] = row
        mask[i, cols] = 1
    return ids, mask


def _object_array(values: list[Any]) -> np.ndarray:
    # np.array(list_of_lists, dtype=object) would build a 2-D array; fill a 1-D one element by element.
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def collate_rl(rows: Sequence[Mapping[str, Any]], pad_token_id: int, pad_to: int | None = None) -> DataProto:
    """Rows from `RLHFDataset.__getitem__` → DataProto with left-padded `input_ids`, `attention_mask`,
    `position_ids` and the non-tensor columns of `RL_NON_TENSOR_KEYS` (plus any other non-tensor keys)."""
    ids, mask = pad_sequences([r[keys.INPUT_IDS] for r in rows], pad_token_id, "left", pad_to)
    tensors = {keys.INPUT_IDS: ids, keys.ATTENTION_MASK: mask, keys.POSITION_IDS: position_ids_from_mask(mask)}
    columns = [k for k in rows[0] if k != keys.INPUT_IDS] if rows else []
    non_tensors = {k: _object_array([r[k] for r in rows]) for k in columns}
    return DataProto(batch=tensors, non_tensor_batch=non_tensors)


def collate_sft(rows: Sequence[Mapping[str, Any]], pad_token_id: int) -> DataProto:
    """SFT rows (`input_ids`, `loss_mask`) → right-padded `input_ids`, `attention_mask`, `position_ids`,
    `loss_mask` (1 on response tokens: the tokens the model is trained to predict)."""
    ids, mask = pad_sequences([r[keys.INPUT_IDS] for r in rows], pad_token_id, "right")
    loss, _ = pad_sequences([r["loss_mask"] for r in rows], 0, "right", ids.shape[1])
    tensors = {keys.INPUT_IDS: ids, keys.ATTENTION_MASK: mask, keys.POSITION_IDS: position_ids_from_mask(mask),
               "loss_mask": loss}
    extra = {k: _object_array([r[k] for r in rows]) for k in rows[0] if k not in (keys.INPUT_IDS, "loss_mask")}
    return DataProto(batch=tensors, non_tensor_batch=extra)


def collate_preference(rows: Sequence[Mapping[str, Any]], pad_token_id: int) -> DataProto:
    """Preference rows → `chosen_*` and `rejected_*` (input_ids, attention_mask, position_ids), both right-padded
    to one common length so a reward model can score them in one forward pass after `torch.cat`."""
    width = max(max(len(r["chosen_input_ids"]), len(r["rejected_input_ids"])) for r in rows)
    tensors: dict[str, torch.Tensor] = {}
    for side in ("chosen", "rejected"):
        ids, mask = pad_sequences([r[f"{side}_input_ids"] for r in rows], pad_token_id, "right", width)
        tensors.update({f"{side}_input_ids": ids, f"{side}_attention_mask": mask,
                        f"{side}_position_ids": position_ids_from_mask(mask)})
    skip = ("chosen_input_ids", "rejected_input_ids")
    extra = {k: _object_array([r[k] for r in rows]) for k in rows[0] if k not in skip}
    return DataProto(batch=tensors, non_tensor_batch=extra)
