"""``data.packing: auto``: the batch layout for this data, chosen at the start of a run.

Auto chooses between padding (each micro-batch padded to its longest example), group_by_length (examples
of similar length batched together, in transformers' order, drawn from the run's seed: a resume
reproduces it, ``training/step/trainer.py``) and packing (examples packed into rows of up to
``data.max_seq_len`` tokens). The run times them (``memory/layout_costs.py``) and takes the one with the
most real tokens per second (``speeds``); where it cannot time them, the one that pads least. Which pads
less depends on the data: packing wins on examples of very different lengths, but a set of short examples
of similar length packs into few, unevenly filled rows and pads more than plain padding. The shares are
the ones ``qlora-kit data`` prints (``prepare.pad_shares``), measured on the training set under the run's
micro-batch and seed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from qlora_kit.data import images, prepare
from qlora_kit.data.packing import FlattenedRowsCollator, pack_dataset
from qlora_kit.model import loading, recurrent
from qlora_kit.registries import attention, objectives

if TYPE_CHECKING:
    from qlora_kit.recipe.data import DataSection
    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)

LAYOUTS = ("padding", "group_by_length", "packing")  # in order of preference when shares tie
AUTO = LAYOUTS  # what auto chooses from: the layouts a resume reproduces exactly (all three)


COLUMNS = ("input_ids", "labels", "position_ids")  # what the collators read from a row


def allowed_layouts(recipe: Recipe, prepared: prepare.PreparedData) -> tuple[str, ...]:
    """The layouts this run may use: preference pairs and rollouts pad (TRL pads them itself); a kernel
    not known to keep packed examples apart, a model whose layers carry a state along the row
    (model/recurrent.py), or image rows the family cannot pack (logged), do not pack."""
    if not objectives.of(recipe).packs:
        return ("padding",)
    if attention.kernel(recipe.model.attn_implementation).packing is None:
        return ("padding", "group_by_length")
    if why := recurrent.packing_refusal(loading.load_config(recipe.model)):
        if recipe.data.packing == "auto":
            log.info("data.packing auto: not packing: %s", why)
        return ("padding", "group_by_length")
    if images.IMAGES_COLUMN in prepared.train.column_names and (
        why := images.packing_refusal(loading.vision_facet(recipe.model), recipe.model.attn_implementation)
    ):
        if recipe.data.packing == "auto":
            log.info("data.packing auto: not packing: %s", why)
        return ("padding", "group_by_length")
    return AUTO


@dataclass
class LaidOut:
    """The training set as one layout trains on it: its rows, the epoch's batches of row indices in the
    Trainer's seeded order, the collator, and the pad share of the positions it computes in an epoch."""

    rows: object
    batches: list[list[int]]
    collator: object
    pad_share: float

    def collated(self, count: int) -> list[dict]:
        """``count`` of the epoch's batches, evenly spaced from the first to the last, collated (on the CPU)."""
        picked = self.batches
        if len(picked) > count:
            step = (len(picked) - 1) / (count - 1)
            picked = [picked[round(i * step)] for i in range(count)]
        kept = [c for c in COLUMNS if c in self.rows.column_names]
        batches = [self.collator(list(self.rows.select(batch).select_columns(kept))) for batch in picked]
        return [{k: v for k, v in inputs.items() if k != "labels"} for inputs in batches]


def lay_out(
    recipe: Recipe, prepared: prepare.PreparedData, tokenizer, allowed: tuple[str, ...]
) -> dict[str, LaidOut]:
    """Each ``allowed`` layout of the training set as the run would lay it out (``prepare.epoch_batches``,
    the run's collator)."""
    data, train = recipe.data, recipe.train
    seed, size = train.seed, train.micro_batch_size
    laid_out = {}
    for name in allowed:
        rows = pack_dataset(prepared.train, data.max_seq_len) if name == "packing" else prepared.train
        lengths = [len(ids) for ids in rows["input_ids"]]
        grouped = name == "group_by_length"  # megabatches of the global batch, as the Trainer groups
        batches = prepare.epoch_batches(lengths, size, grouped, seed, size * train.grad_accum)
        collator = prepare.build_collator(tokenizer, name == "packing", recipe.model.attn_implementation)
        flattened = isinstance(collator, FlattenedRowsCollator)
        positions = sum(
            sum(lengths[i] for i in b) if flattened else max(lengths[i] for i in b) * len(b) for b in batches
        )
        laid_out[name] = LaidOut(rows, batches, collator, 1 - sum(lengths) / positions)
    return laid_out


def choose_layout(shares: dict[str, float], allowed: tuple[str, ...] = AUTO) -> str:
    """The allowed layout with the smallest pad share (the simpler one on a tie)."""
    return min(allowed, key=lambda layout: (round(shares[layout], 6), LAYOUTS.index(layout)))


def resolve_layout(
    prepared: prepare.PreparedData,
    data: DataSection,
    batch_size: int,
    seed: int,
    allowed: tuple[str, ...],
    speeds: dict[str, float] | None = None,
    measured: str = "",
) -> tuple[DataSection, prepare.PreparedData]:
    """The data section with ``packing: auto`` replaced by the chosen layout, and the prepared sets laid
    out that way (packed when packing wins); logged with the figures it chose by. ``allowed``: the layouts
    the run can use (an attention kernel not known to keep packed examples apart cannot pack, preference
    pairs only pad). ``speeds``: each allowed layout's real tokens per second as timed (``measured`` says
    how), the most wins; without them, the least padding. Anything but auto is returned as is."""
    if data.packing != "auto":
        return data, prepared
    shares = prepare.pad_shares(prepared, data, batch_size, seed)
    if data.group_by_length:  # asked for explicitly: auto then never packs
        allowed = ("group_by_length",)
    if speeds is not None and len(allowed) > 1 and all(name in speeds for name in allowed):
        layout = max(allowed, key=lambda name: (speeds[name], -LAYOUTS.index(name)))
        slowest = min(speeds[name] for name in allowed)
        figures = ", ".join(f"{name} {speeds[name] / slowest:.2f}x" for name in allowed)
        log.info(
            "data.packing auto: %s, the most real tokens/s (%s; %s)", layout, figures, measured or "measured"
        )
    else:
        layout = choose_layout(shares, allowed)
        log.info(
            "data.packing auto: %s, the least padding on this data (pad tokens per batch of %d: %s)",
            layout,
            batch_size,
            ", ".join(f"{name} {shares[name]:.1%}" for name in LAYOUTS),
        )
    chosen = data.model_copy(
        update={"packing": layout == "packing", "group_by_length": layout == "group_by_length"}
    )
    if layout == "packing":
        val = pack_dataset(prepared.val, data.max_seq_len) if prepared.val is not None else None
        prepared = replace(prepared, train=pack_dataset(prepared.train, data.max_seq_len), val=val)
    return chosen, prepared
