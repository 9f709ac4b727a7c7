"""Packing: several short examples per row of up to ``data.max_seq_len`` tokens, with no attention
between them and almost no padding.

Examples are placed into rows best-fit-decreasing (the longest first, each into the row it fills the
most), as TRL's ``bfd`` packing and axolotl's multipack do. Inside a row, position ids restart at 0 for
every example. The first label of every example is -100: it would otherwise be predicted from the end
of the previous example. How rows reach the attention kernel depends on it (``attention.py``):

- sdpa, eager, flex_attention (``PackedRowCollator``): rows with no attention mask; transformers reads
  the restarting position ids and builds a block-diagonal causal mask, so each token attends only to
  its own example. Rows rather than one flattened sequence: without a varlen kernel attention costs
  the square of a sequence's length, which rows bound by ``max_seq_len`` squared.
- flash kernels (``FlattenedRowsCollator``): transformers' flash path finds packed sequences only in a
  batch of one row, so the micro-batch's rows are split back into their examples and flattened into
  one sequence by transformers' ``DataCollatorWithFlattening``, with the example boundaries as the
  varlen kernel's ``cu_seq_lens_q/k`` and ``max_length_q/k``: no padding and no quadratic mask at all.
"""

from __future__ import annotations

import bisect
import itertools
from typing import TYPE_CHECKING, Any

import torch

from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.data.images import IMAGES_COLUMN as IMAGES

if TYPE_CHECKING:
    from datasets import Dataset

# Tokens handled as Python lists at once (~36 bytes a token per list): packing takes examples in chunks
# of this many tokens at most (best fit within a chunk), and tokenizing flushes to the arrow cache as
# often, so data bigger than memory is never held whole (benchmarks/results/large-data-cpu.md).
TOKENS_PER_BATCH = 2**19


def examples_per_batch(max_seq_len: int) -> int:
    """How many examples of up to ``max_seq_len`` tokens make a batch of ``TOKENS_PER_BATCH``."""
    return max(64, TOKENS_PER_BATCH // max_seq_len)


def pack_dataset(dataset: Dataset, capacity: int) -> Dataset:
    """Rows of packed examples (input_ids, labels, position_ids, and the images of rows that have them),
    each at most ``capacity`` tokens."""

    with_images = IMAGES in dataset.column_names  # a vision-language model's rows (data/images.py)

    def pack(batch: dict[str, list]) -> dict[str, list]:
        rows = best_fit_decreasing([len(ids) for ids in batch["input_ids"]], capacity)
        packed: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
        if with_images:
            packed[IMAGES] = []
        for members in rows:
            ids, labels, positions, files = [], [], [], []
            for i in members:
                ids += batch["input_ids"][i]
                labels += [IGNORE_INDEX, *batch["labels"][i][1:]]
                positions += range(len(batch["input_ids"][i]))
                if with_images:  # the row's images in the order of their tokens, as the model pairs them
                    files += batch[IMAGES][i] or []
            packed["input_ids"].append(ids)
            packed["labels"].append(labels)
            packed["position_ids"].append(positions)
            if with_images:
                packed[IMAGES].append(files)
        return packed

    rows = examples_per_batch(capacity)
    return dataset.map(
        pack,
        batched=True,
        batch_size=rows,
        writer_batch_size=rows,
        remove_columns=dataset.column_names,
        desc="packing",
    )


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices grouped into bins of total length <= capacity; each item goes into the fullest bin it fits."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (free space, bin index), kept sorted
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        spot = bisect.bisect_left(free, (lengths[i], -1))
        if spot < len(free):
            space, b = free.pop(spot)
            bins[b].append(i)
            bisect.insort(free, (space - lengths[i], b))
        else:
            bins.append([i])
            bisect.insort(free, (capacity - lengths[i], len(bins) - 1))
    return bins


class PackedRowCollator:
    """Pads packed rows to the longest in the batch. Padding forms its own block (positions restart at 0,
    labels -100) that no real token can attend to, since it comes after them; no attention mask is sent."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        width = max(len(f["input_ids"]) for f in features)
        batch: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
        for f in features:
            pad = width - len(f["input_ids"])
            batch["input_ids"].append(list(f["input_ids"]) + [self.pad_token_id] * pad)
            batch["labels"].append(list(f["labels"]) + [IGNORE_INDEX] * pad)
            batch["position_ids"].append(list(f["position_ids"]) + list(range(pad)))
        return {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}


class FlattenedRowsCollator:
    """A micro-batch of packed rows as one sequence for a varlen (flash) kernel: (1, total) input ids,
    labels and position ids, with ``cu_seq_lens_q/k`` (int32 example boundaries) and ``max_length_q/k``."""

    def __init__(self) -> None:
        from transformers import DataCollatorWithFlattening

        # separator -100: the first label of each example, as packed rows already have it
        self.flatten = DataCollatorWithFlattening(return_flash_attn_kwargs=True, separator_id=IGNORE_INDEX)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        return self.flatten([example for row in features for example in examples_of(row)])


def examples_of(row: dict[str, Any]) -> list[dict[str, list[int]]]:
    """A packed row split back into its examples, where the position ids restart."""
    positions = list(row["position_ids"])
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
    return [
        {"input_ids": list(row["input_ids"][a:b]), "labels": list(row["labels"][a:b])}
        for a, b in itertools.pairwise(starts)
    ]
