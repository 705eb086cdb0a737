"""Collate SFT rows and preference pairs into the TrainEngine's batch layout, so SFT, RM (and later DPO) train
through exactly the engine path PPO uses (packing, FSDP2, micro-batching).

Layout: `input_ids` [B, P+R] = prompt LEFT-padded to P | response RIGHT-padded to R; `attention_mask`,
`position_ids`, `responses` [B, R], `response_mask` [B, R] = the tokens trained on (SFT: the loss mask; pairs:
every response token). The prompt/response cut of an SFT row is its first loss token; of a pair, the longest
common prefix of chosen and rejected (their shared prompt). Pairs are interleaved (chosen_0, rejected_0,
chosen_1, ...) with `pair_chosen` [B] = 1/0, so fixed-size micro-batches of an even size never split a pair.
Score slot: a pair row's response ends with one extra (pad) token. The engine's training outputs are values at
the position BEFORE each response token, so the value at that slot is the scalar head at the sequence's real
last token — exactly the engine's `score` head, which scores responses during PPO (causal attention: the
slot never changes earlier positions).
Legend: B rows, P prompt width, R response width.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from hybridflow.data.collate import pad_sequences, position_ids_from_mask
from hybridflow.protocol import DataProto, keys
from hybridflow.protocol.indexing import to_object_array


def _as_list(x: Any) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def split_at_first_loss_token(ids: Sequence[int], loss_mask: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """(prompt, response, response_mask) of an SFT row: the response starts at the first loss token."""
    ids, loss_mask = _as_list(ids), _as_list(loss_mask)
    first = next((i for i, m in enumerate(loss_mask) if m), None)
    if first is None:
        raise ValueError("an SFT row has no response tokens (loss_mask is all zero); it was probably cut by the "
                         "maximum length: raise data.max_prompt_length / data.max_response_length")
    if first == 0:
        raise ValueError("an SFT row starts with a response token; the engine needs at least one prompt token "
                         "before the response (give a non-empty prompt)")
    return ids[:first], ids[first:], loss_mask[first:]


def engine_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                 response_masks: Sequence[Sequence[int]] | None, pad_token_id: int) -> DataProto:
    """Rows of (prompt, response[, mask]) token ids → the engine layout (module docstring)."""
    p_ids, p_mask = pad_sequences(prompts, pad_token_id, "left")
    r_ids, r_mask = pad_sequences(responses, pad_token_id, "right")
    if r_ids.shape[1] == 0:
        raise ValueError("every response in the batch is empty")
    loss_mask = r_mask if response_masks is None else pad_sequences(response_masks, 0, "right", r_ids.shape[1])[0]
    attention = torch.cat([p_mask, r_mask], dim=1)
    return DataProto.from_dict({
        keys.INPUT_IDS: torch.cat([p_ids, r_ids], dim=1),
        keys.ATTENTION_MASK: attention,
        keys.POSITION_IDS: position_ids_from_mask(attention),
        keys.RESPONSES: r_ids,
        keys.RESPONSE_MASK: loss_mask * r_mask,
    })


def collate_sft_rows(items: Sequence[Mapping[str, Any]], pad_token_id: int) -> DataProto:
    """`SFTDataset` items ({input_ids, loss_mask[, multi_modal_inputs]}) → one engine-layout batch; the items'
    image tensors become the non-tensor column `multi_modal_inputs`, as in RL batches."""
    parts = [split_at_first_loss_token(it[keys.INPUT_IDS], it["loss_mask"]) for it in items]
    batch = engine_batch([p for p, _, _ in parts], [r for _, r, _ in parts], [m for _, _, m in parts],
                         pad_token_id)
    if items and keys.MULTI_MODAL_INPUTS in items[0]:
        batch.non_tensor_batch[keys.MULTI_MODAL_INPUTS] = to_object_array([it[keys.MULTI_MODAL_INPUTS] for it in items])
    return batch


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def split_pair(chosen: Sequence[int], rejected: Sequence[int]) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen_response, rejected_response): the shared prefix is the prompt; each response keeps at
    least its last token (the score is read at the last response position, so the cut never changes a score)."""
    chosen, rejected = _as_list(chosen), _as_list(rejected)
    if chosen == rejected:
        raise ValueError("chosen and rejected are identical tokens (e.g. after truncation to the maximum length); "
                         "drop the row or raise data.max_prompt_length / data.max_response_length")
    cut = min(common_prefix_len(chosen, rejected), len(chosen) - 1, len(rejected) - 1)
    if cut < 1:
        raise ValueError("a preference pair shares no prompt token (or a side has a single token); "
                         "both sides must start with the same non-empty prompt")
    return chosen[:cut], chosen[cut:], rejected[cut:]


def collate_pairs(items: Sequence[Mapping[str, Any]], pad_token_id: int, score_slot: bool = True) -> DataProto:
    """`PreferenceDataset` items ({chosen_input_ids, rejected_input_ids}) → 2×pairs rows, interleaved, each
    response followed by the score slot (module docstring) when `score_slot` (reward models; a log-prob
    objective such as DPO sets it false and sums `log_probs` over `response_mask` per row instead)."""
    slot = [pad_token_id] if score_slot else []
    prompts, responses = [], []
    for i, it in enumerate(items):
        try:
            prompt, chosen, rejected = split_pair(it["chosen_input_ids"], it["rejected_input_ids"])
        except ValueError as err:  # the dataset checks the texts at load; this is what their tokens still allow
            raise ValueError(f"preference row {it.get('index', i)}: {err}") from err
        prompts += [prompt, prompt]
        responses += [chosen + slot, rejected + slot]
    batch = engine_batch(prompts, responses, None, pad_token_id)
    batch.batch["pair_chosen"] = torch.tensor([1, 0] * len(items), dtype=torch.long)
    index = np.empty(2 * len(items), dtype=object)
    index[:] = [it.get("index", i) for i, it in enumerate(items) for _ in (0, 1)]
    batch.non_tensor_batch["pair_index"] = index
    return batch


def pair_halves(x_B: torch.Tensor, pair_chosen_B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) halves of an interleaved pair batch; raises if a micro-batch split a pair."""
    chosen, rejected = pair_chosen_B[0::2], pair_chosen_B[1::2]
    if pair_chosen_B.numel() % 2 or not (bool((chosen == 1).all()) and bool((rejected == 0).all())):
        raise ValueError("a micro-batch does not hold whole (chosen, rejected) pairs in order; pair losses need "
                         "fixed-size micro-batches of an even number of rows (use_dynamic_bsz must be false)")
    return x_B[0::2], x_B[1::2]


def last_response_values(values_BR: torch.Tensor, mask_BR: torch.Tensor) -> torch.Tensor:
    """values_BR at each row's last valid response position [B] (the score slot of a pair row)."""
    last_B = (mask_BR.sum(-1) - 1).clamp(min=0).long()
    return values_BR.gather(1, last_B.unsqueeze(1)).squeeze(1)
