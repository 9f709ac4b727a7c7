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
from dataclasses import replace
from typing import TYPE_CHECKING

from qlora_kit.data import prepare
from qlora_kit.data.packing import pack_dataset

if TYPE_CHECKING:
    from qlora_kit.recipe.data import DataSection

log = logging.getLogger(__name__)

LAYOUTS = ("padding", "group_by_length", "packing")  # in order of preference when shares tie
AUTO = LAYOUTS  # what auto chooses from: the layouts a resume reproduces exactly (all three)


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
