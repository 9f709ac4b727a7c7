"""One resolved run: what a recipe leaves to the machine, the data or the launch, resolved once (by
``pipeline.build``) and read by every stage after it, none of which resolves it again:

- the objective's entry in the objective table (registries/objectives.py);
- the launch: accelerate's FSDP settings when launched with them, else None (distributed.py);
- the mixed precision: ``auto`` -> bf16, fp16 or no on this device (model/precision.py);
- the layout: ``data.packing: auto`` -> padding, group_by_length or packing, whichever trains the most
  real tokens a second as timed (memory/layout_costs.py; else the least padding, data/layout.py), in ``recipe``,
  and the figures it chose by, in ``layout_costs``;
- the checkpointing policy: ``memory.checkpointing: auto`` -> the planner's choice and the recompute costs
  it chose by (memory/auto.py), in ``memory`` (``recipe.memory`` stays as written: the run's log says
  what auto chose, and why).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qlora_kit.model.precision import resolve_mixed_precision
from qlora_kit.registries import objectives
from qlora_kit.training.distributed import launched_fsdp_settings

if TYPE_CHECKING:
    from qlora_kit.memory.layer_costs import LayerCosts
    from qlora_kit.memory.layout_costs import LayoutCosts
    from qlora_kit.recipe.memory import MemorySection
    from qlora_kit.recipe.recipe import Recipe


@dataclass(frozen=True)
class ResolvedRun:
    recipe: Recipe  # data.packing resolved for this data
    as_written: Recipe  # what recipe.yaml holds and the trackers log
    objective: objectives.ObjectiveSpec
    launch: dict[str, str] | None
    precision: str  # bf16, fp16 or no
    memory: MemorySection  # memory.checkpointing resolved
    layer_costs: LayerCosts | None  # what checkpointing auto measured (into every checkpoint, for --resume)
    output_dir: Path
    layout_costs: LayoutCosts | None = (
        None  # what data.packing auto timed (into every checkpoint, for --resume)
    )

    @classmethod
    def as_given(cls, recipe: Recipe, output_dir: Path) -> ResolvedRun:
        """A recipe whose data layout and checkpointing need no resolving (no ``auto``), resolved for a
        Trainer built outside ``pipeline.build`` (tests, benchmarks)."""
        return cls(
            recipe=recipe,
            as_written=recipe,
            objective=objectives.of(recipe),
            launch=launched_fsdp_settings(),
            precision=resolve_mixed_precision(recipe),
            memory=recipe.memory,
            layer_costs=None,
            output_dir=output_dir,
        )
