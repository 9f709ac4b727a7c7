"""``builtin:shapes``: a vision-language demo set of coloured shapes, drawn deterministically at first use.

Each image is a white canvas holding shapes of one kind (squares, circles or triangles) in one colour; two
chat rows ask about it: "What colour is the <shape>?" / "How many <shape>s are there?", answered in one
word. The training and validation images are drawn from different seeds, so the held-out images are
unseen; the questions are the same kind, which is what a visible held-out rise on a tiny model needs.
Rows are ``format: chat`` with ``{"type": "image", "path": ...}`` parts, paths relative to the data file,
as a user's image rows are written (data/images.py).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

SIZE = 56  # pixels a side: the tiny vision tower's input, no resize
# every other image is taller, its shapes on the same 56 x 56 square in the middle: a dynamic-resolution
# family (Qwen-VL) gives it more tokens (6 to 4), LLaVA's centre crop keeps the square, Gemma-3 squeezes it
TALL = 84
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
SHAPES = ("square", "circle", "triangle")
COUNTS = {1: "one", 2: "two", 3: "three"}
TRAIN_IMAGES, VAL_IMAGES = 96, 24
VERSION = 3  # bump when the drawing changes, so an older cache is not reused


def draw(shape: str, colour: str, count: int, rng: random.Random) -> Image.Image:
    """``count`` shapes of one kind and colour at random places on a white canvas, never overlapping."""
    image = Image.new("RGB", (SIZE, SIZE), "white")
    pen = ImageDraw.Draw(image)
    side = 12
    cells = rng.sample([(x, y) for x in range(3) for y in range(3)], count)  # a 3 x 3 grid of slots
    for x, y in cells:
        left, top = 4 + x * 17 + rng.randint(0, 3), 4 + y * 17 + rng.randint(0, 3)
        box = (left, top, left + side, top + side)
        if shape == "square":
            pen.rectangle(box, fill=COLOURS[colour])
        elif shape == "circle":
            pen.ellipse(box, fill=COLOURS[colour])
        else:
            pen.polygon(
                [(left + side // 2, top), (left, top + side), (left + side, top + side)], fill=COLOURS[colour]
            )
    return image


def rows_for(image: str, shape: str, colour: str, count: int) -> list[dict]:
    def row(question: str, answer: str) -> dict:
        return {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "path": image}, {"type": "text", "text": question}],
                },
                # a list of parts in every message: one JSON type per column, as Arrow needs
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            ]
        }

    return [row(f"What colour is the {shape}?", colour), row(f"How many {shape}s are there?", COUNTS[count])]


def canvas(image: Image.Image, index: int) -> Image.Image:
    """The odd-numbered images on a taller white canvas (two sizes in every batch), the drawing centred."""
    if index % 2 == 0:
        return image
    tall = Image.new("RGB", (SIZE, TALL), "white")
    tall.paste(image, (0, (TALL - SIZE) // 2))
    return tall


def write_split(folder: Path, name: str, images: int, seed: int) -> Path:
    rng = random.Random(seed)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    rows = []
    for index in range(images):
        shape, colour, count = rng.choice(SHAPES), rng.choice(list(COLOURS)), rng.choice(list(COUNTS))
        relative = f"images/{name}-{index:03d}.png"
        canvas(draw(shape, colour, count, rng), index).save(folder / relative)
        rows += rows_for(relative, shape, colour, count)
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def ensure_shapes(cache: Path) -> tuple[Path, Path]:
    """The training and validation files of ``builtin:shapes`` under ``cache``, drawn the first time."""
    from qlora_kit.model.builtin import build_into

    key = hashlib.sha256(
        json.dumps([VERSION, SIZE, TALL, COLOURS, SHAPES, TRAIN_IMAGES, VAL_IMAGES]).encode()
    ).hexdigest()
    folder = cache / "datasets" / f"shapes-{key[:12]}"
    if not (folder / "val.jsonl").exists():

        def build(staging: Path) -> None:
            write_split(staging, "train", TRAIN_IMAGES, seed=1)
            write_split(staging, "val", VAL_IMAGES, seed=2)

        build_into(folder, build, marker="val.jsonl")
    return folder / "train.jsonl", folder / "val.jsonl"
