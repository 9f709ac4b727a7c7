"""``data.packing: auto``: the batch layout with the least padding on this data, chosen at the start of a run.

Auto chooses between padding (each micro-batch padded to its longest example) and packing (examples
packed into rows of up to ``data.max_seq_len`` tokens). Which pads less depends on the data: packing
wins on examples of very different lengths, but a set of short examples of similar length packs into
few, unevenly filled rows and pads more than plain padding. The shares are the ones ``qlora-kit data``
prints (``prepare.pad_shares``), measured on the training set under the run's micro-batch and seed.

group_by_length (similar lengths batched together) usually pads least of all, but auto leaves it to be
asked for: its sampler draws each epoch's order from the global random state, so a run killed and
resumed is not bit-identical to one that was not (measured: tests/e2e/test_keep_best.py diverged after
the resume), where padding and packing are.
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
AUTO = ("padding", "packing")  # what auto chooses from: the layouts a resume reproduces exactly


def choose_layout(shares: dict[str, float], allowed: tuple[str, ...] = AUTO) -> str:
    """The allowed layout with the smallest pad share (the simpler one on a tie)."""
    return min(allowed, key=lambda layout: (round(shares[layout], 6), LAYOUTS.index(layout)))


def resolve_layout(
    prepared: prepare.PreparedData, data: DataSection, batch_size: int, seed: int, allowed: tuple[str, ...]
) -> tuple[DataSection, prepare.PreparedData]:
    """The data section with ``packing: auto`` replaced by the chosen layout, and the prepared sets laid
    out that way (packed when packing wins); logged with the three shares. ``allowed``: the layouts the
    run can use (an attention kernel not known to keep packed examples apart cannot pack, preference pairs
    only pad). Anything but auto is returned as is."""
    if data.packing != "auto":
        return data, prepared
    shares = prepare.pad_shares(prepared, data, batch_size, seed)
    if data.group_by_length:  # asked for explicitly: auto then never packs
        allowed = ("group_by_length",)
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
