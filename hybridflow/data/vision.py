"""Images of vision-language prompts (Qwen2.5-VL style): verl's `images` column → pixel values + prompt ids.

A row carries `images` (a list of `{"bytes": ...}` dicts, raw bytes or PIL images) and a prompt whose text holds one
`<image>` placeholder per image, in order. Decision: the prompt is rendered by the chat template as text, then each
placeholder becomes `<|vision_start|>` + one `<|image_pad|>` per merged patch + `<|vision_end|>`, exactly the ids
`Qwen2_5_VLProcessor` makes from a rendered prompt (tests/data/test_vision_data.py compares them); only the image
processor is needed (no video processor, hence no torchvision). A row's tensors (`pixel_values` [patches, D],
`image_grid_thw` [images, 3]) travel in the non-tensor column `multi_modal_inputs`, so any re-ordering, split or
repeat of the batch keeps them with their row.

Bad image rows fail where the data is loaded, in the driver, never on a worker: at dataset build, each image's type,
header and size (one the image processor refuses); at `__getitem__`, the decode and the row's tensors against each
other, the image processor's patch size and the prompt's image tokens (`VisionPrompts.check_inputs`). A row that
failed on one rank inside a forward would leave the other ranks waiting in FSDP2's next gather.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image

from hybridflow.data.templates import MalformedRow
from hybridflow.protocol import keys

IMAGE_PLACEHOLDER = "<image>"
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
IMAGE_KEY = "images"  # verl's column name
PIXEL_VALUES, IMAGE_GRID_THW = "pixel_values", "image_grid_thw"


# What decoding bad image bytes raises (PIL: OSError for truncated data, SyntaxError for some corrupt files,
# DecompressionBombError for absurd sizes; the image processor: ValueError, e.g. an aspect ratio over 200).
DECODE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def check_images(row: dict[str, Any], messages: list[dict[str, str]], vision: VisionPrompts | None = None
                 ) -> list[Any]:
    """The row's images, checked against its `<image>` placeholders (and, given `vision`, each image's size against
    its image processor); raises MalformedRow saying what is wrong."""
    images = row.get(IMAGE_KEY)
    images = [] if images is None else list(images.tolist() if hasattr(images, "tolist") else images)
    wanted = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
    if wanted != len(images):
        raise MalformedRow(f"the prompt has {wanted} {IMAGE_PLACEHOLDER} placeholder(s) but the row has "
                           f"{len(images)} image(s) in {IMAGE_KEY!r}; give one image per placeholder, in order")
    for j, img in enumerate(images):
        data = img.get("bytes") if isinstance(img, dict) else img
        if not isinstance(data, (bytes, Image.Image)) or (isinstance(data, bytes) and not data):
            raise MalformedRow(f"{IMAGE_KEY}[{j}] must be image bytes, a {{'bytes': ...}} dict or a PIL image, "
                               f"got {type(img).__name__}{' without bytes' if isinstance(img, dict) else ''}")
        if isinstance(data, bytes):
            try:
                Image.open(io.BytesIO(data))  # reads the header only
            except DECODE_ERRORS as err:
                raise MalformedRow(f"{IMAGE_KEY}[{j}] is not a readable image ({err})") from err
        if vision is not None:
            try:
                vision.token_counts([img])
            except ValueError as err:
                raise MalformedRow(f"{IMAGE_KEY}[{j}]: the image processor refuses its size ({err}); resize or "
                                   "crop the image, or drop the row") from err
    return images


def decode_image(img: Any) -> Image.Image:
    data = img.get("bytes") if isinstance(img, dict) else img
    pil = data if isinstance(data, Image.Image) else Image.open(io.BytesIO(data))
    return pil.convert("RGB")


class VisionPrompts:
    """Renders image prompts into ids and pixel values for one tokenizer + HF image processor."""

    def __init__(self, tokenizer: Any, image_processor: Any) -> None:
        missing = [t for t in (VISION_START, IMAGE_PAD, VISION_END) if t not in tokenizer.get_vocab()]
        if missing:
            raise ValueError(f"the tokenizer lacks the vision tokens {missing}; use the model's own tokenizer "
                             "(model.tokenizer_path) — image prompts need a Qwen2.5-VL-style vocabulary")
        self.image_processor = image_processor
        self.merge = int(getattr(image_processor, "merge_size", 2))
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(IMAGE_PAD))
        patch = getattr(image_processor, "patch_size", None)
        temporal = getattr(image_processor, "temporal_patch_size", None)
        # values per patch row of pixel_values: RGB x temporal patch x patch^2 (None: a processor without these)
        self.patch_dim = 3 * int(temporal) * int(patch) ** 2 if patch and temporal else None

    def token_counts(self, images: Sequence[Any]) -> list[int]:
        """Image tokens of each image, from its size alone (the file header: no pixels decoded)."""
        sizes = [(i.get("bytes") if isinstance(i, dict) else i) for i in images]
        sizes = [s.size if isinstance(s, Image.Image) else Image.open(io.BytesIO(s)).size for s in sizes]
        return [self.image_processor.get_number_of_image_patches(h, w, {}) // self.merge ** 2 for w, h in sizes]

    @staticmethod
    def expand(text: str, counts: Sequence[int]) -> str:
        """Each `<image>` of `text` → vision start, `counts[i]` image pads (one per merged patch), vision end."""
        pieces = text.split(IMAGE_PLACEHOLDER)
        assert len(pieces) == len(counts) + 1, (len(pieces) - 1, counts)
        return pieces[0] + "".join(VISION_START + IMAGE_PAD * n + VISION_END + p for n, p in zip(counts, pieces[1:]))

    def tensors(self, images: Sequence[Any]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """({pixel_values, image_grid_thw}, image tokens of each image) of a non-empty list of images."""
        out = self.image_processor(images=[decode_image(i) for i in images], return_tensors="pt")
        mm = {PIXEL_VALUES: out[PIXEL_VALUES], IMAGE_GRID_THW: out[IMAGE_GRID_THW].long()}
        return mm, (mm[IMAGE_GRID_THW].prod(-1) // self.merge ** 2).tolist()

    def check_inputs(self, mm: dict[str, Any], ids: Sequence[int] | torch.Tensor, where: str) -> None:
        """ValueError naming `where` (the data row) unless the row's `multi_modal_inputs` `mm` fit each other, the
        image processor's patches and the prompt `ids`' image tokens (one per merged patch). A row without images
        has `mm` = {} and must hold no image tokens."""
        column = f"{where}: column {keys.MULTI_MODAL_INPUTS!r}"
        pads = int((torch.as_tensor(ids) == self.image_token_id).sum())
        if not mm:
            if pads:
                raise ValueError(f"{where}: the prompt holds {pads} {IMAGE_PAD} tokens but the row has no images; "
                                 f"write images as {IMAGE_PLACEHOLDER} with the image in {IMAGE_KEY!r}, not as "
                                 "vision tokens in the text")
            return
        pixels, grid = mm.get(PIXEL_VALUES), mm.get(IMAGE_GRID_THW)
        if not isinstance(pixels, torch.Tensor) or not isinstance(grid, torch.Tensor):
            raise ValueError(f"{column} must hold tensors {PIXEL_VALUES!r} and {IMAGE_GRID_THW!r}, got "
                             f"{sorted(mm)} of types {[type(v).__name__ for v in mm.values()]}; use a Qwen2-VL-style "
                             "image processor (model.path's preprocessor_config.json)")
        want = f"[patches, {self.patch_dim or 'D'}]"
        if pixels.ndim != 2 or not pixels.is_floating_point() or (self.patch_dim and pixels.shape[1] != self.patch_dim):
            raise ValueError(f"{column}: {PIXEL_VALUES} is {pixels.dtype} {tuple(pixels.shape)}, not floating point "
                             f"{want}; use the model's own image processor (patch_size, temporal_patch_size)")
        if grid.ndim != 2 or grid.shape[1] != 3 or grid.is_floating_point() or bool((grid <= 0).any()):
            raise ValueError(f"{column}: {IMAGE_GRID_THW} is {grid.dtype} {grid.tolist()}, not positive integer "
                             "(t, h, w) rows, one per image; use the model's own image processor")
        patches = int(grid.prod(-1).sum())
        if patches != pixels.shape[0]:
            raise ValueError(f"{column}: {IMAGE_GRID_THW} {grid.tolist()} makes {patches} patches but {PIXEL_VALUES} "
                             f"has {pixels.shape[0]}; use the model's own image processor")
        if pads != patches // self.merge ** 2:
            raise ValueError(f"{where}: the prompt holds {pads} {IMAGE_PAD} tokens but its images make "
                             f"{patches // self.merge ** 2} ({patches} patches / merge {self.merge}^2); write each "
                             f"image as one {IMAGE_PLACEHOLDER} in the prompt, never as vision tokens")

    def __call__(self, text: str, images: Sequence[Any]) -> tuple[str, dict[str, torch.Tensor]]:
        """(rendered text with expanded placeholders, {pixel_values, image_grid_thw}) of one prompt."""
        if not images:
            return text, {}
        mm, counts = self.tensors(images)
        return self.expand(text, counts), mm


def batch_vision_inputs(rows: Sequence[dict[str, torch.Tensor]] | None, input_ids: torch.Tensor,
                        image_token_id: int) -> dict[str, torch.Tensor]:
    """The HF forward's image arguments for a batch whose row i has `rows[i]` (its `multi_modal_inputs`): pixel
    values and grids concatenated in row order, `mm_token_type_ids` (1 at image pads) for the mrope positions."""
    if rows is None:
        return {}
    rows = [r for r in rows if r]
    if not rows:
        return {}
    pad_rows = int((input_ids == image_token_id).any(-1).sum())
    assert pad_rows == len(rows), f"{pad_rows} rows hold image tokens but {len(rows)} rows carry images"
    return {PIXEL_VALUES: torch.cat([r[PIXEL_VALUES] for r in rows]),
            IMAGE_GRID_THW: torch.cat([r[IMAGE_GRID_THW] for r in rows]),
            "mm_token_type_ids": (input_ids == image_token_id).int()}


def vision_column(non_tensor: dict[str, Any]) -> Sequence[dict[str, torch.Tensor]] | None:
    """The batch's `multi_modal_inputs` column, or None for a text-only batch."""
    col = non_tensor.get(keys.MULTI_MODAL_INPUTS)
    return None if col is None else list(col)
