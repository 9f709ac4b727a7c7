"""``data.packing: auto``'s stage, which ``pipeline.build`` calls once the data is prepared: the layouts
this run may use and each one's batches (data/layout.py), timed through a few of the model's 4-bit
layers (memory/layout_costs.py) or read back from the checkpoint a resumed run continues, and the
choice (data/layout.py). It sits here because it reads both: the layout's choice lives with the data,
its timing with the memory measurements, and neither imports the other.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from qlora_kit.data import images, layout
from qlora_kit.memory import layout_costs
from qlora_kit.memory.shapes import load_config
from qlora_kit.training.compile_choice import steps_of

if TYPE_CHECKING:
    from qlora_kit.data.mixture import PreparedData
    from qlora_kit.memory.layout_costs import LayoutCosts
    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)


def resolve(
    recipe: Recipe, prepared: PreparedData, tokenizer, checkpoint: Path | None, precision: str
) -> tuple[Recipe, PreparedData, LayoutCosts | None]:
    """``data.packing: auto`` -> the layout with the most real tokens per second, timed here or read back
    from the checkpoint a resumed run continues, else the least padding (data/layout.py); the rest of the
    run reads the resolved recipe. Returns the figures too, for every checkpoint."""
    allowed = layout.allowed_layouts(recipe, prepared)
    costs = None
    train = recipe.train
    # the micro-batches it trains, over unpacked rows: packing makes fewer, so the count is an upper bound
    # and a run that might repay the timing is timed
    per_step = train.micro_batch_size * train.grad_accum
    planned = steps_of(train.max_steps, len(prepared.train), per_step, train.epochs) * train.grad_accum
    if recipe.data.packing == "auto" and not recipe.data.group_by_length and len(allowed) > 1:
        # a resumed run lays its data out as its first part did: by its figures, or (none) by padding
        if checkpoint is not None:
            costs = layout_costs.read(checkpoint)
        elif images.IMAGES_COLUMN in prepared.train.column_names:
            log.info("data.packing auto: image rows are not timed; choosing by padding")
        elif planned < (
            timed := layout_costs.timed_micro_batches(
                len(allowed), load_config(recipe).get_text_config().num_hidden_layers
            )
        ):
            log.info(
                "data.packing auto: %d planned micro-batches, fewer than the %d timing the layouts runs; "
                "choosing by padding",
                planned,
                timed,
            )
        else:
            laid_out = layout.lay_out(recipe, prepared, tokenizer, allowed)
            batches = {name: lay.collated(layout_costs.BATCHES) for name, lay in laid_out.items()}
            shares = {name: lay.pad_share for name, lay in laid_out.items()}
            costs = layout_costs.measure(recipe, batches, shares, precision)
    speeds = costs.tokens_per_s() if costs else None
    measured = costs.source if costs else ""
    data, prepared = layout.resolve_layout(
        prepared, recipe.data, train.micro_batch_size, train.seed, allowed, speeds, measured
    )
    return recipe.model_copy(update={"data": data}), prepared, costs
