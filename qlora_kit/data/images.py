"""Chat rows with images, for a vision-language model: tokens, labels, and never an image cut in two.

A row's messages carry images the way the processors' chat templates take them: a message's ``content``
is a list of parts, ``{"type": "text", "text": ...}`` and ``{"type": "image", "path": ...}`` (a local file,
relative to the data file's folder). ShareGPT rows name their images in an ``images`` column, one per
``<image>`` in the text, in order.

The row is rendered as a text row is (data/chat.py: the assistant's replies and their end-of-turn markers
trained, nothing else), with each image part written as the family's image marker (the families table's
``vision.image_marker``, what its chat template writes for an image). Each marker's token is then replaced
by the run of tokens the family's own processor makes for that image (its placeholder tokens and any
start/end markers), labelled -100: image tokens are never trained, whatever the template says. The
images' pixels are read again by the collator (``ImageCollator``), so the prepared dataset holds paths,
not pixel arrays.

A row longer than ``data.max_seq_len`` is dropped (``data.overlong: drop``) or cut on the text side only:
the cut moves back to before an image whose run it would split, and the images past the cut leave the
row with their tokens. Bad input is one line naming the row (data/prepare.py adds the file and the row):
a missing or unreadable image, a count of images that differs from the count of image markers, an image
in a row for a text-only model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qlora_kit.data.formats import IGNORE_INDEX, RowError

if TYPE_CHECKING:
    from qlora_kit.registries.families import Vision

IMAGES_COLUMN = "images"  # a ShareGPT row's image paths
TEXT_COLUMNS = (
    "input_ids",
    "labels",
    "position_ids",
)  # what the text collators read (packed rows: positions)
SHAREGPT_MARKER = "<image>"


def image_paths(messages: list[Any]) -> list[str]:
    """The image parts' paths, in order (empty for a text-only conversation)."""
    paths = []
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            paths += [part.get("path") or part.get("image") for part in content if _is_image(part)]
    return paths


def _parts(message: dict) -> list:
    content = message.get("content")
    return content if isinstance(content, list) else []


def _is_video(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "video"


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image"


def flattened(messages: list[Any], marker: str) -> list[dict[str, Any]]:
    """The messages with each content list joined into text, an image part written as ``marker``."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            text = ""
            for part in content:
                if _is_image(part):
                    text += marker
                elif isinstance(part, dict) and part.get("type") == "text":
                    text += part.get("text") or ""
                else:
                    raise RowError(
                        f"a content part must be {{'type': 'text'}} or {{'type': 'image'}} (got {part!r})"
                    )
            message = {**message, "content": text}
        out.append(message)
    return out


def video_refusal() -> str:
    """Why a row's video part is refused: qlora_kit prepares images only, and where torchvision does not
    import (transformers' video processors need it) no video could be read either."""
    from qlora_kit.model.vision import torchvision_imports

    why = (
        ""
        if torchvision_imports()
        else " (and transformers' video processors need torchvision, which does not import here)"
    )
    return f"a video part: qlora_kit trains on image parts only{why}; give the frames as images"


def sharegpt_images(messages: list[dict[str, Any]], images: list[str]) -> list[dict[str, Any]]:
    """ShareGPT rows: the ``images`` column's paths become image parts where the text says ``<image>``."""
    count = sum(m["content"].count(SHAREGPT_MARKER) for m in messages if isinstance(m.get("content"), str))
    if count != len(images):
        raise RowError(
            f"{len(images)} images in the images column but {count} {SHAREGPT_MARKER} markers in the text"
        )
    remaining = iter(images)
    out = []
    for message in messages:
        pieces = message["content"].split(SHAREGPT_MARKER)
        parts: list[dict[str, Any]] = []
        for i, piece in enumerate(pieces):
            if i:
                parts.append({"type": "image", "path": next(remaining)})
            if piece:
                parts.append({"type": "text", "text": piece})
        out.append({**message, "content": parts if len(pieces) > 1 else message["content"]})
    return out


def with_images_as_markers(
    row: dict[str, Any], data, folder: Path, marker: str | None
) -> tuple[dict, list[Path]]:
    """A chat or ShareGPT row whose conversation holds images: the row with its messages' parts joined into
    text, each image written as ``marker``, and the image files in order. A row without images comes back as
    it was; ``marker`` None (a text-only model) refuses a row with images."""
    from qlora_kit.data.chat import sharegpt_messages

    if "messages" in row and row["messages"] is not None:
        messages = row["messages"]
    elif row.get(IMAGES_COLUMN):  # ShareGPT: {from, value} turns and an images column
        messages = sharegpt_images(
            sharegpt_messages(row["conversations"], data.roles), list(row[IMAGES_COLUMN])
        )
    else:
        return row, []
    if any(_is_video(part) for m in messages if isinstance(m, dict) for part in _parts(m)):
        raise RowError(video_refusal())
    paths = image_paths(messages)
    if not paths:
        return row, []
    if marker is None:
        raise RowError(
            f"{len(paths)} image(s) in a row for a text-only model (model.path is not a vision-language model)"
        )
    files = [resolve(path, folder) for path in paths]
    # the conversation as chat messages (a ShareGPT row keeps its own fields: formats.py renders messages)
    return {**row, "messages": flattened(messages, marker)}, files


def resolve(path: str | None, folder: Path) -> Path:
    """An image part's file, relative to the data file's folder; a missing one is a row error."""
    if not path:
        raise RowError("an image part has no path")
    if "://" in str(path):
        raise RowError(f"image {path}: only local image files are read (no downloads)")
    file = (folder / Path(path).expanduser()).resolve()
    if not file.is_file():
        raise RowError(f"image {path}: no such file ({file})")
    return file


def open_image(file: Path):
    """The image in RGB; an unreadable one, or one too large to decode safely, is a row error."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    try:
        # Pillow warns of an image above Image.MAX_IMAGE_PIXELS (89 million pixels) and raises above twice
        # that: a small file that decodes to gigabytes (a decompression bomb) is refused before it decodes
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(file) as image:
                return image.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise RowError(
            f"image {file.name}: too large to decode safely (over {Image.MAX_IMAGE_PIXELS:,} pixels: a "
            "decompression bomb, or a picture to shrink first)"
        ) from None
    except (UnidentifiedImageError, OSError) as exc:
        raise RowError(f"image {file.name}: cannot be read as an image ({exc.__class__.__name__})") from None


@dataclass
class ImageRuns:
    """What a family's processor makes of one image: the token run that replaces its marker, and the
    model's inputs beside the tokens (the pixels, and the token types a family such as Gemma-3 takes)."""

    processor: Any  # transformers' processor of the model (its image processor and tokenizer)
    vision: Vision  # the families table's facet
    config: Any = None  # the model's config, for an M-RoPE family's packed positions (data/mrope.py)

    @property
    def marker(self) -> str:
        return self.vision.image_marker

    @property
    def expanded(self) -> str:
        """The marker's token that becomes the image's run (Qwen: the pad between its start/end markers)."""
        return self.vision.expanded_token or self.vision.image_marker

    @property
    def marker_id(self) -> int:
        return self.processor.tokenizer.convert_tokens_to_ids(self.expanded)

    def run(self, image) -> list[int]:
        # no special tokens: a Llama tokenizer would put a BOS before every image's run
        return list(
            self.processor(text=self.expanded, images=[image], add_special_tokens=False)["input_ids"][0]
        )

    def model_inputs(self, input_ids, pictures: list, position_ids=None) -> dict[str, Any]:
        """The image processor's outputs for ``pictures`` (the batch's images in order) that the model
        takes (``pixel_values``, and e.g. Qwen-VL's grid sizes: the facet's ``image_inputs``) and, for a
        family that takes them, ``token_type_ids``: 1 on each image feature's token, as its processor
        marks them. For an M-RoPE family, its token types and, for packed rows (``position_ids``), each
        example's own 3-D positions (data/mrope.py)."""
        made = self.processor.image_processor(pictures, return_tensors="pt") if pictures else {}
        inputs = {name: made[name] for name in self.vision.image_inputs if name in made}
        feature = self.processor.tokenizer.convert_tokens_to_ids(self.vision.feature_token)
        if self.vision.token_type_ids and pictures:  # none: no block, and sdpa keeps its causal fast path
            inputs["token_type_ids"] = (input_ids == feature).long()
        if self.vision.mrope and pictures:  # what get_rope_index reads to give image tokens 3-D positions
            inputs["mm_token_type_ids"] = (input_ids == feature).int()
        if self.vision.mrope and position_ids is not None:
            # packed rows, with images or without: 1-D positions alone would be spread over the three axes
            # and build no packed mask (transformers reads it from the 4-row form only), joining examples
            from qlora_kit.data import mrope

            rope_index = mrope.rope_index_of(self.config)
            grids = inputs.get("image_grid_thw")
            inputs["position_ids"] = mrope.packed_positions(
                rope_index, input_ids, position_ids, feature, grids
            )
        return inputs


def image_runs(model_section) -> ImageRuns | None:
    """A vision-language model's processor and image marker (None for a text-only model)."""
    from qlora_kit.model import loading

    found = loading.load_processor(model_section)
    if not found:
        return None
    processor, vision = found
    return ImageRuns(processor, vision, loading.load_config(model_section) if vision.mrope else None)


def one_example_a_row(data):
    """The data section unpacked: a vision-language model's evaluations ask each held-out row's question
    with its own images (a packed row's would be every example's); the loss per token is the same."""
    return data.model_copy(update={"packing": False})


def packing_refusal(facet: Vision | None, attn_implementation: str) -> str | None:
    """Why rows with images cannot be packed for a model of the vision ``facet`` (the families table's) under
    the attention kernel ``attn_implementation`` (None: they can). Rows kept apart by a mask (sdpa, eager,
    flex_attention) pack images as they pack text: each example its own attention, positions and images
    (tests/test_vision.py: equal per-example losses on LLaVA)."""
    from qlora_kit.registries import attention

    if facet is not None and facet.token_type_ids:
        # transformers (5.24) ORs an image's both-ways block into the sliding-window layers' mask before
        # remapping positions to packed examples, so the blocks of a row's first example stand for every
        # example's: tokens of later examples would see their own future (measured: tests/test_vision.py)
        return (
            f"{facet.processor_class.removesuffix('Processor')}'s image blocks are not kept apart in packed rows "
            "by transformers' sliding-window mask; its image rows are padded"
        )
    if attention.kernel(attn_implementation).packing != "rows":
        # a varlen (flash) kernel takes each example causally and no mask, which a family whose image
        # tokens attend both ways would need
        return "rows with images pack for a mask kernel (sdpa, eager, flex_attention), not a varlen one"
    return None


def expand(example: dict[str, list[int]], files: list[Path], runs: ImageRuns) -> dict[str, Any]:
    """Each image marker's token replaced by its image's run (labels -100), in order; the counts must agree."""
    ids, labels = example["input_ids"], example["labels"]
    markers = [i for i, token in enumerate(ids) if token == runs.marker_id]
    if len(markers) != len(files):
        raise RowError(f"{len(files)} images but {len(markers)} image markers in the rendered conversation")
    out_ids: list[int] = []
    out_labels: list[int] = []
    spans: list[tuple[int, int]] = []  # each image's run, [start, end) in the expanded ids
    previous = 0
    for at, file in zip(markers, files, strict=True):
        out_ids += ids[previous:at]
        out_labels += labels[previous:at]
        run = runs.run(open_image(file))
        spans.append((len(out_ids), len(out_ids) + len(run)))
        out_ids += run
        out_labels += [IGNORE_INDEX] * len(run)
        previous = at + 1
    out_ids += ids[previous:]
    out_labels += labels[previous:]
    return {"input_ids": out_ids, "labels": out_labels, "images": [str(f) for f in files], "spans": spans}


def cut(example: dict[str, Any], max_len: int) -> dict[str, Any]:
    """The example cut to ``max_len`` tokens on the text side: never inside an image's run (the cut moves
    back to before it), and the images past the cut leave with their runs."""
    end = max_len
    for start, stop in example["spans"]:
        if start < end < stop:
            end = start
    kept = [i for i, (_, stop) in enumerate(example["spans"]) if stop <= end]
    return {
        "input_ids": example["input_ids"][:end],
        "labels": example["labels"][:end],
        "images": [example["images"][i] for i in kept],
        "spans": [example["spans"][i] for i in kept],
    }


class ImageCollator:
    """Pads the text as the padding collator does and adds the batch's images as the model takes them
    (``ImageRuns.model_inputs``), the images of every row in order."""

    def __init__(self, text_collator, runs: ImageRuns) -> None:
        self.text_collator, self.runs = text_collator, runs

    @property
    def processor(self):
        """The model's processor: the run saves it with the adapter (training/pipeline.py)."""
        return self.runs.processor

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        pictures = [
            open_image(Path(path)) for feature in features for path in feature.get(IMAGES_COLUMN) or []
        ]
        text = [{k: v for k, v in f.items() if k in TEXT_COLUMNS} for f in features]
        batch = self.text_collator(text)
        batch.update(self.runs.model_inputs(batch["input_ids"], pictures, batch.get("position_ids")))
        return batch
