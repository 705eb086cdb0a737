"""Remove padding and pack a micro-batch into one row, with the indices that map results back to [B, R].

Layout in (verl): `input_ids` [B, L=P+R], prompt left-padded to P, response right-padded to R, so each row's
valid tokens are contiguous. Packing keeps only valid tokens, row after row, into [1, T] with per-sequence
`position_ids` and `cu_seqlens` [B+1]. Response token j of row b is predicted by the hidden state one position
earlier (`src`), which is the same whether the batch is packed or padded — only the flat index differs.
Batches with images (vision-language models) stay padded: the HF forward derives the multimodal (3-D) rope
positions from the mask, the image tokens and each image's grid.
Legend: B rows, L padded length, P/R prompt/response width, T packed tokens, K valid response tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from hybridflow.utils.device import to_device


@dataclass(frozen=True)
class ModelInputs:
    """What the model sees plus where response outputs come from and go to."""

    input_ids: torch.Tensor  # [1, T] packed or [B, L] padded
    position_ids: torch.Tensor  # same shape as input_ids
    attention_mask: torch.Tensor | None  # [B, L] when padded; None when packed
    cu_seqlens: torch.Tensor | None  # [B+1] int32 when packed
    max_seqlen: int  # longest sequence (packed) or L (padded)
    src_K: torch.Tensor  # flat index into the model's [N*T, H] hidden states predicting each response token
    dst_K: torch.Tensor  # flat index into [B*R] of each valid response token
    labels_K: torch.Tensor  # the response token ids at those positions
    last_K: torch.Tensor  # flat hidden index of each row's last valid token (reward scores) [B]
    seqlens_B: torch.Tensor  # valid tokens per row
    vision: dict[str, torch.Tensor] | None = None  # image arguments of the HF forward (`data.vision`), padded only
    # training, no image here but on another rank: the vision tower gets a zero gradient (`idle_tower_zero`)
    idle_tower: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.seqlens_B.sum())

    def to(self, device: torch.device) -> ModelInputs:
        """Tensors to `device` (non-blocking from pinned memory on a GPU); built on the host, the indices cost the
        GPU no sync."""
        moved = {f.name: to_device(v, device) if isinstance(v, torch.Tensor) and f.name != "seqlens_B" else v
                 for f in fields(self) for v in [getattr(self, f.name)]}
        if self.vision is not None:
            moved["vision"] = {k: to_device(v, device) for k, v in self.vision.items()}
        return ModelInputs(**moved)


def build_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 response_length: int, packed: bool, vision: dict[str, torch.Tensor] | None = None) -> ModelInputs:
    """Model inputs for one micro-batch in the packed or padded layout (see module docstring); `vision` (the
    batch's image arguments, `data.vision.batch_vision_inputs`) forces the padded layout."""
    packed = packed and not vision
    B, L = input_ids.shape
    R = response_length
    if R <= 0 or R >= L:
        raise ValueError(f"response length {R} must be in [1, {L - 1}] for input_ids of width {L}")
    valid_BL = attention_mask.bool()
    seqlens_B = valid_BL.sum(-1)
    resp_valid_BR = valid_BL[:, L - R:]
    if bool((resp_valid_BR.any(-1) & ~valid_BL[:, L - R - 1]).any()):
        raise ValueError("a row has response tokens but no prompt token before them (prompt must be non-empty)")
    rows, cols = resp_valid_BR.nonzero(as_tuple=True)
    cols_abs = cols + (L - R)
    dst_K = rows * R + cols
    labels_K = input_ids[rows, cols_abs]
    # Column of each row's last valid token (right-padded response ⇒ last True in the row).
    last_col_B = L - 1 - valid_BL.flip(-1).int().argmax(-1)
    if packed:
        flat_BL = torch.cumsum(valid_BL.flatten().long(), 0).view(B, L) - 1
        src_K = flat_BL[rows, cols_abs] - 1
        last_B = flat_BL[torch.arange(B, device=input_ids.device), last_col_B]
        cu = torch.zeros(B + 1, dtype=torch.int32, device=input_ids.device)
        cu[1:] = torch.cumsum(seqlens_B, 0)
        return ModelInputs(
            input_ids=input_ids[valid_BL].unsqueeze(0), position_ids=position_ids[valid_BL].unsqueeze(0),
            attention_mask=None, cu_seqlens=cu, max_seqlen=int(seqlens_B.max()), src_K=src_K, dst_K=dst_K,
            labels_K=labels_K, last_K=last_B, seqlens_B=seqlens_B,
        )
    src_K = rows * L + cols_abs - 1
    last_B = torch.arange(B, device=input_ids.device) * L + last_col_B
    return ModelInputs(
        input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, cu_seqlens=None,
        max_seqlen=L, src_K=src_K, dst_K=dst_K, labels_K=labels_K, last_K=last_B, seqlens_B=seqlens_B,
        vision=vision or None,
    )


def scatter_to_responses(values_K: torch.Tensor, dst_K: torch.Tensor, batch: int, response_length: int) -> torch.Tensor:
    """[K] values at valid response positions → [B, R] with zeros elsewhere (differentiable)."""
    out = values_K.new_zeros(batch * response_length)
    return out.index_put((dst_K,), values_K).view(batch, response_length)
