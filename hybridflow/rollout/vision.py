"""Vision-language prompts in the native engine (Qwen2.5-VL): the vision tower once per prompt, 3-D rope positions.

Decision: the engine does not port the vision tower. It runs the actor's own `visual` module (through HF's
`get_image_features`, LoRA and FSDP2 included) once per prompt before scheduling, under no_grad, and keeps each
prompt's image embeddings until its prefill, where they replace the image-pad embeddings; the positions come from
HF's own `get_rope_index` (the trainer's forward calls the same function). Prefill applies the multimodal RoPE
(`forward.RopeTable.at` on [B, P, 3] positions); decode positions continue at max(prompt position) + 1 for all three
components, where mrope equals plain RoPE, so the decode step and its CUDA graphs are those of a text model.
Partial rollouts (`trainer.async.partial_rollout=continue`): weights may change between the encoding and a prompt's
prefill (a prompt admitted after a swap); its images are encoded again, under the weights in effect, at admission.
Not covered natively (refused with the key to change): multi-turn, tensor parallelism, exact log-probs, fp8, agents.

Legend: B prompts, P prompt length, H hidden, N image tokens.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from hybridflow.data.vision import IMAGE_GRID_THW, PIXEL_VALUES

logger = logging.getLogger(__name__)

VL_MODEL_TYPES = ("qwen2_5_vl",)  # a Qwen2 decoder beside a vision tower: native prefill with images
# Tokens never sampled: a response holding an image pad would no longer match its images in the trainer's forward.
VISION_TOKEN_IDS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
MAX_PATCHES_PER_CALL = 65536  # vision-tower patches encoded per call (bounds its activations; prompts stay whole)


def is_vision_language(module: nn.Module) -> bool:
    return getattr(getattr(module, "config", None), "vision_config", None) is not None


def suppressed_ids(config: object) -> list[int]:
    """The vision token ids of a model config (empty for a text model)."""
    return sorted({int(getattr(config, k)) for k in VISION_TOKEN_IDS if getattr(config, k, None) is not None})


def check_options(cfg: object, *, exact: bool, multi_turn: bool) -> None:
    """ValueError naming the key when a vision-language model is asked for what the native engine does not cover."""
    asked = {"actor_rollout.exact_logprobs=true": exact, "rollout.multi_turn.enable=true": multi_turn,
             f"rollout.tensor_model_parallel_size={cfg.tensor_model_parallel_size}": cfg.tensor_model_parallel_size > 1,
             "rollout.quantization=fp8": cfg.quantization == "fp8",
             "rollout.agent.mode=server": getattr(getattr(cfg, "agent", None), "mode", None) == "server"}
    bad = [k for k, on in asked.items() if on]
    if bad:
        raise ValueError(f"{', '.join(bad)} with a vision-language model: the rollout engine runs these models "
                         "with images in prefill only, on one rank and without these options; turn them off")


@dataclass
class PromptImages:
    """A batch's image inputs for prefill: 3-D positions of every prompt and the image embeddings of each."""

    pos_BP3: torch.Tensor  # (t, h, w) rope positions; text tokens have three equal components
    embeds: list[torch.Tensor | None]  # prompt i's image-token embeddings [N_i, H] (None: no image)
    image_token_id: int
    # Partial rollouts: `stamp()` names the weights in effect (it changes when new ones are installed mid-call),
    # `renew(prompts)` encodes those prompts' images again under them; `at[i]`: the stamp prompt i was encoded at.
    stamp: Callable[[], int] | None = None
    renew: Callable[[list[int]], dict[int, torch.Tensor]] | None = None
    at: list[int] = field(default_factory=list)

    def take(self, prompts: Sequence[int]) -> torch.Tensor | None:
        """The image embeddings of `prompts`, in their order, as one [N, H] tensor (None when none has images);
        those encoded under weights since replaced are encoded again first."""
        if self.stamp is not None:
            now = self.stamp()
            stale = [p for p in prompts if self.embeds[p] is not None and self.at[p] != now]
            if stale:
                for p, e in self.renew(stale).items():
                    self.embeds[p], self.at[p] = e, now
        got = [self.embeds[p] for p in prompts if self.embeds[p] is not None]
        return torch.cat(got) if got else None


def input_embeds(x_BPH: torch.Tensor, ids_BP: torch.Tensor, image_NH: torch.Tensor | None,
                 image_token_id: int) -> torch.Tensor:
    """The token embeddings with the image embeddings at the image-pad positions (row-major order, as HF)."""
    if image_NH is None:
        return x_BPH
    pads = (ids_BP == image_token_id)[..., None]
    assert int(pads.sum()) == image_NH.shape[0], (int(pads.sum()), tuple(image_NH.shape))
    return x_BPH.masked_scatter(pads, image_NH.to(x_BPH.dtype))


def encode(module: nn.Module, ids_BP: torch.Tensor, mask_BP: torch.Tensor,
           rows: Sequence[dict[str, torch.Tensor] | None] | None, dtype: torch.dtype,
           stamp: Callable[[], int] | None = None) -> PromptImages | None:
    """Run the vision tower over each prompt's `multi_modal_inputs` (row i of the batch) and compute the batch's
    3-D positions; None for a batch without images. Collective under FSDP2 over several ranks (the root's
    parameters are gathered): every rank calls it at each generate, with or without images. `stamp` (partial
    rollouts: the weights may change during the call) names the weights in effect; a prompt is encoded again at
    its prefill when it changed since (`PromptImages.take`)."""
    cfg = module.config
    image_id = int(cfg.image_token_id)
    has = [bool(r) for r in rows] if rows is not None else [False] * ids_BP.shape[0]
    pads_B = (ids_BP == image_id).sum(-1).tolist()
    for i, (h, n) in enumerate(zip(has, pads_B)):
        if h != (n > 0):
            raise ValueError(f"prompt row {i} has {n} image-pad tokens but {'' if h else 'no '}images in "
                             "multi_modal_inputs; build image prompts with data/vision.py (one image per <image>)")
    if stamp is not None and isinstance(module, FSDPModule):  # encoding again at a prefill runs on one rank only
        raise ValueError("new weights during a generate call (trainer.async.partial_rollout=continue) with images "
                         "need the rollout worker's own unsharded model (trainer.mode=async), not the FSDP2 actor")
    with _gathered(module):
        if not any(has):
            return None
        dev = ids_BP.device

        def encode_prompts(prompts: list[int]) -> dict[int, torch.Tensor]:
            out = {}
            for chunk in _chunks(rows, prompts):
                pixels = torch.cat([rows[i][PIXEL_VALUES] for i in chunk]).to(dev)
                grid = torch.cat([rows[i][IMAGE_GRID_THW] for i in chunk]).to(dev)
                feats = _image_features(module, pixels, grid, dtype)
                out.update(zip(chunk, feats.split([pads_B[i] for i in chunk])))
            return out

        with_images = [i for i, h in enumerate(has) if h]
        encoded = encode_prompts(with_images)
    embeds = [encoded.get(i) for i in range(len(has))]
    grid = torch.cat([r[IMAGE_GRID_THW] for r, h in zip(rows, has) if h]).to(dev)
    images = PromptImages(rope_positions(module, ids_BP, mask_BP, grid), embeds, image_id)
    if stamp is not None:
        images.stamp, images.renew, images.at = stamp, encode_prompts, [stamp()] * len(has)
    return images


def rope_positions(module: nn.Module, ids_BP: torch.Tensor, mask_BP: torch.Tensor,
                   grid: torch.Tensor) -> torch.Tensor:
    """HF's `get_rope_index` over the left-padded batch (pads at 0), as [B, P, 3]. transformers 5 takes the
    token types (1 = image pad); 4.x derives them from the ids."""
    get_rope_index = module.model.get_rope_index
    kw = dict(input_ids=ids_BP, image_grid_thw=grid, attention_mask=mask_BP)
    if "mm_token_type_ids" in inspect.signature(get_rope_index).parameters:
        kw["mm_token_type_ids"] = (ids_BP == module.config.image_token_id).int()
    pos_3BP, _ = get_rope_index(**kw)
    return pos_3BP.permute(1, 2, 0)


def _image_features(module: nn.Module, pixels: torch.Tensor, grid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The vision tower's merged-patch embeddings [N, H] in `dtype` (autocast to it when the tower's parameters are
    in another dtype; the unsharded FSDP2 parameters are in its compute dtype)."""
    dev = pixels.device
    cast = next(module.model.visual.parameters()).dtype != dtype
    with torch.no_grad(), torch.autocast(dev.type, dtype=dtype, enabled=cast):
        out = module.model.get_image_features(pixels, grid)
    feats = getattr(out, "pooler_output", out)  # transformers 5: an output object; 4.x: the per-image tuple
    feats = torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats
    return feats.to(dtype)


def _chunks(rows: Sequence[dict[str, torch.Tensor] | None], prompts: Sequence[int]) -> Iterator[list[int]]:
    """`prompts` (each with images) grouped up to MAX_PATCHES_PER_CALL patches per vision-tower call."""
    chunk, patches = [], 0
    for i in prompts:
        n = int(rows[i][PIXEL_VALUES].shape[0])
        if chunk and patches + n > MAX_PATCHES_PER_CALL:
            yield chunk
            chunk, patches = [], 0
        chunk.append(i)
        patches += n
    if chunk:
        yield chunk


@contextlib.contextmanager
def _gathered(module: nn.Module) -> Iterator[None]:
    """The root FSDP2 group (it holds the vision tower) unsharded for the duration; nothing without FSDP2."""
    if not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def mrope_components(rotary: nn.Module, head_dim: int) -> torch.Tensor | None:
    """For each rotary dim, which position component (0 t, 1 h, 2 w) rotates it — the rotary embedding's
    `mrope_section` over half the head, repeated for the second half, as HF recomposes the frequencies; None for a
    plain RoPE."""
    section = getattr(rotary, "mrope_section", None)
    if not section:
        return None
    half = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(section)])
    assert 2 * half.numel() == head_dim, (section, head_dim)
    return torch.cat([half, half])
