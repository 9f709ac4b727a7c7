"""``checkpointing: auto``'s cost model, measured: what a selective and a full decoder layer add to a step,
timed once per run on its device at its micro-batch shape.

Counting FLOPs (``tracing.RecomputeCost``) ranks a selective recompute far below a full one; on a CPU at
small widths the opposite can hold. There a step is mostly per-op Python and dispatch work (peft's LoRA
wrappers, bitsandbytes' ``Linear4bit``, the dropout's random draws), and a selective layer pays it twice
over: its forward pass runs every op through torch's caching dispatch mode, and its backward replays the
whole layer in Python even where every output is cached (benchmarks/checkpointing_frontier.py's floor
row: a policy that saves every op steps about as slowly as full checkpointing). So ``auto`` times the
three policies on the run's own layers before it chooses:

1. ``cut_model.LAYERS`` of the model's decoder layers, built at random and loaded as the run loads them
   (``cut_model.py``: 4-bit, on this process's device, checkpointing and LoRA as the run sets them up);
2. one forward and backward pass of the layers (the head left out: it is the same under every policy)
   under the Trainer's autocast, for none, selective and full in turn, ``ROUNDS`` rounds after a warm-up,
   on ``cut_model``'s clock (on a CPU one thread's CPU seconds; one thread ranks the policies as two do:
   selective no cheaper than full, benchmarks/selective_floor.py);
3. a policy's cost is its median step minus none's, per layer (never below 0).

A resumed run must choose the same layers, and a second measurement would differ by noise, so the
costs are written into every checkpoint (``COSTS_FILE``, ``write``) and a ``--resume`` reads them back
(``read``). Where the layers cannot be measured (a config alone, a model whose code fails here, several
processes, which could each measure a different plan) auto counts FLOPs instead, and says so.
"""

from __future__ import annotations

import logging
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qlora_kit.memory import saved_facts
from qlora_kit.registries import checkpointing as table

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)

COSTS_FILE = "checkpointing_costs.json"  # in each checkpoint: the costs a resumed run chooses with
ROUNDS = 7  # timed rounds (their median) after one warm-up round
POLICIES = tuple(table.layer_policies())  # timed in turn, the table's layer policies


@dataclass(frozen=True)
class LayerCosts:
    """Seconds one decoder layer adds to a step under each recomputing layer policy (selective, full: the
    fields a checkpoint's file has always held; ``more``: any later policy's)."""

    selective: float
    full: float
    source: str  # how they were found, for the log and ``plan``: "measured on cpu, ..."
    more: dict[str, float] = field(default_factory=dict)

    def of(self, policy: str) -> float:
        if not table.recomputes(policy):
            return 0.0
        return self.more[policy] if policy in self.more else getattr(self, policy)


def write(folder: Path, costs: LayerCosts) -> None:
    saved_facts.write(folder, COSTS_FILE, costs)


def read(folder: Path | None) -> LayerCosts | None:
    """The costs a checkpoint was trained with; None when it has none (it chose without measuring)."""
    return saved_facts.read(folder, COSTS_FILE, LayerCosts)


def measure(recipe: Recipe, config, batch: int, seq: int, precision: str) -> LayerCosts | None:
    """Time the three policies on ``cut_model.LAYERS`` of the model's layers (module docstring); None (logged) where
    they cannot be timed here."""
    if config is None:
        return None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        log.info(
            "checkpointing auto: %s processes would time their layers apart; counting FLOPs",
            os.environ["WORLD_SIZE"],
        )
        return None
    from qlora_kit.memory.cut_model import release

    try:
        seconds = _time_policies(recipe, config, batch, seq, precision)
    except Exception as exc:  # a foreign model's code that cannot be built or run here: count instead
        log.info("checkpointing auto: timing the layers failed (%s); counting FLOPs", exc)
        return None
    finally:
        release()  # the cut model's memory, before the run's model loads
    layers = seconds.pop("layers")
    base = seconds[table.NONE]
    extra = {p: max(0.0, seconds[p] - base) / layers for p in POLICIES if table.recomputes(p)}
    device = seconds.pop("device")
    source = (
        f"measured on {device}{'' if device == 'cuda' else ' (one thread)'}: a step of {layers} layers {base * 1000:.1f} ms, "
        + ", ".join(
            f"{p} +{extra[p] * 1000:.2f} ms" + (" a layer" if i == 0 else "") for i, p in enumerate(extra)
        )
    )
    named = {p: s for p, s in extra.items() if p in LayerCosts.__dataclass_fields__}  # selective, full
    return LayerCosts(**named, source=source, more={p: s for p, s in extra.items() if p not in named})


def _time_policies(recipe: Recipe, config, batch: int, seq: int, precision: str) -> dict:
    from qlora_kit.memory import checkpointing
    from qlora_kit.memory.accounting import decoder_layers
    from qlora_kit.memory.cut_model import cut_model
    from qlora_kit.memory.loss_head import final_hidden_states

    # Selective on every layer; full and none are that setup with the selective context taken off or
    # checkpointing switched off (``checkpointing._mix``, what a per-layer plan does).
    selective = recipe.memory.model_copy(update={"checkpointing": table.of_kind(table.KEEPS_EXPENSIVE)})
    with cut_model(recipe, config, selective, precision) as cut:
        layers = decoder_layers(cut.base)
        selective_funcs = [layer._gradient_checkpointing_func for layer in layers]
        vocab = cut.base.get_input_embeddings().num_embeddings
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0)).to(cut.device)

        def step(policy: str) -> float:
            for layer, func in zip(layers, selective_funcs, strict=True):
                layer._gradient_checkpointing_func = func
            checkpointing._mix(layers, [policy] * len(layers), None)
            cut.synchronize()
            start = cut.clock()
            with cut.autocast:
                hidden = final_hidden_states(cut.peft_model, {"input_ids": ids}, cut.base)
            hidden.float().square().mean().backward()
            cut.synchronize()
            return cut.clock() - start

        times: dict[str, list[float]] = {p: [] for p in POLICIES}
        for round_index in range(ROUNDS + 1):  # interleaved: a slow spell of a shared machine hits them all
            for policy in POLICIES:
                seconds = step(policy)
                if round_index:
                    times[policy].append(seconds)
    result: dict = {p: statistics.median(t) for p, t in times.items()}
    result["layers"], result["device"] = len(layers), cut.device.type
    return result
