"""The `colour_count` task: a 32x32 image of coloured squares on a 4x4 grid; "How many red?" → "#### <count>".

The smallest vision-language problem whose answer needs the image (the question alone gives one of 3 colours). A
layout is 16 characters, one per cell (`.` empty, `r`/`g`/`b`); images are drawn as PNG bytes when rows are made,
in verl's `images` column ({"bytes": ...}). Scored by exact answer (`rewards.synthetic.colour_count`). A flawed
demonstration (`sft.label_noise`) gives the count without the "####" the scorer reads: RL can fix the format before the
model counts well (a random-init tiny-vl learns to see only slowly).
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from PIL import Image

from hybridflow.protocol import keys

GRID, CELL = 4, 8  # 4x4 cells of 8x8 pixels: one cell = one merged 2x2 patch of the tiny-vl preset
COLOURS = {"r": ("red", (220, 30, 30)), "g": ("green", (30, 200, 30)), "b": ("blue", (30, 30, 220))}
NUM_PROBLEMS = 20_000


def layouts(num: int = NUM_PROBLEMS, seed: int = 0) -> Iterator[tuple[str, str]]:
    """(layout, asked colour letter) pairs, a fixed sequence: 1-6 squares of random colours in random cells."""
    rng = random.Random(seed)
    for _ in range(num):
        cells = ["."] * (GRID * GRID)
        for pos in rng.sample(range(GRID * GRID), rng.randint(1, 6)):
            cells[pos] = rng.choice("rgb")
        yield "".join(cells), rng.choice("rgb")


def space() -> Iterator[tuple[str, str, str]]:
    """(question, answer, layout) of every problem; the question holds the image placeholder."""
    for layout, colour in layouts():
        yield f"<image>How many {COLOURS[colour][0]}?", str(layout.count(colour)), layout


def flawed(row: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """`row` with the demonstration "<count>" (no "####", so it scores 0) instead of "#### <count>"."""
    return {**row, "response": str(row[keys.REWARD_MODEL]["ground_truth"])}


@lru_cache(maxsize=NUM_PROBLEMS)
def draw(layout: str) -> bytes:
    """PNG bytes of `layout` (white background); cached, as training repeats problems."""
    img = Image.new("RGB", (GRID * CELL, GRID * CELL), (255, 255, 255))
    for i, c in enumerate(layout):
        if c in COLOURS:
            x, y = (i % GRID) * CELL, (i // GRID) * CELL
            img.paste(COLOURS[c][1], (x + 1, y + 1, x + CELL - 1, y + CELL - 1))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
