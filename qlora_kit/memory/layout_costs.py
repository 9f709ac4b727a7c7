"""``data.packing: auto`` weighs time: each candidate layout's real tokens per second, measured once per run
on a few of its own batches, and the layout with the most chosen.

Padding share alone misleads where a computed position costs more in one layout than another: on
SmolLM2-135M under this CPU's emulated bf16, packing, which pads least, was the slowest layout (its step
cost more than its extra real tokens: benchmarks/results/data-throughput-real-cpu.md). So
before the weights load, as checkpointing auto times its layers (``memory/layer_costs.py``):

1. each candidate (padding, group_by_length, packing: those the run may use) lays the training set out as
   the run would: the epoch's batches in the Trainer's seeded order (``prepare.epoch_batches``), collated by the run's collator; the positions each layout computes in
   an epoch give its pad share;
2. ``BATCHES`` batches of each, spread over the epoch, go forward and backward through
   ``memory/cut_model.py``'s few 4-bit layers with LoRA (the head left out: the chunked head's cost follows
   the trained tokens, the same in every layout), interleaved over ``ROUNDS`` rounds after a warm-up, on
   its clock; a layout's cost per computed position is its median round's seconds over its positions;
3. real tokens a second = (1 - pad share) / cost per position, and the most wins.

The layouts this run may use, their batches and the choice are the data's (``data/layout.py``); the
stage that times them or reads them back is ``training/batch_layout.py``, which ``pipeline.build`` calls.
This module times the batches it is given and imports nothing from ``data/``.

A resumed run must lay its data out as the run it continues did, so the figures are written into every
checkpoint (``LAYOUT_FILE``) and a ``--resume`` chooses by them; a checkpoint without them (the layouts were
not timed) chooses by padding, as its run did. Not timed, and chosen by padding (logged): a run that plans
fewer micro-batches than the timing runs (``timed_micro_batches``: the timing would cost more than the
whole run, however much the fastest layout saved), several processes (each could time a different
winner), a vision-language model's image rows, a model whose layers cannot be built here. The run's random state is left as it was (``cut_model`` draws from a stream of its own).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qlora_kit.memory import saved_facts
from qlora_kit.registries import checkpointing as table

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)

LAYOUT_FILE = "layout_costs.json"  # in each checkpoint: the figures a resumed run chooses its layout by
BATCHES = 3  # timed batches of each layout, spread over its epoch
ROUNDS = 3  # timed rounds (their median) after one warm-up round


def timed_micro_batches(layouts: int, layers: int) -> int:
    """What timing ``layouts`` layouts costs, in the run's own micro-batches: each round's batches go
    forward and backward (the warm-up round too) through the cut model's layers, a share of the model's
    ``layers``."""
    from qlora_kit.memory.cut_model import LAYERS

    return math.ceil((ROUNDS + 1) * layouts * BATCHES * min(LAYERS, layers) / layers)


@dataclass(frozen=True)
class LayoutCosts:
    """Per layout: seconds per computed position through the timed layers, and the pad share of the
    positions it computes in an epoch."""

    seconds_per_position: dict[str, float]
    pad_shares: dict[str, float]
    source: str  # how they were found, for the log: "measured on cpu (one thread), ..."

    def tokens_per_s(self) -> dict[str, float]:
        """Real tokens a second through the timed layers, per layout."""
        return {name: (1 - self.pad_shares[name]) / s for name, s in self.seconds_per_position.items()}

    def fastest(self, allowed: tuple[str, ...]) -> str:
        speeds = self.tokens_per_s()
        return max((name for name in allowed if name in speeds), key=speeds.__getitem__)

    def summary(self) -> str:
        speeds = self.tokens_per_s()
        slowest = min(speeds.values())
        return ", ".join(
            f"{name} {speeds[name] / slowest:.2f}x ({self.pad_shares[name]:.1%} pad)" for name in speeds
        )


def write(folder: Path, costs: LayoutCosts) -> None:
    saved_facts.write(folder, LAYOUT_FILE, costs)


def read(folder: Path | None) -> LayoutCosts | None:
    """The figures a checkpoint's run chose its layout by; None when it has none."""
    return saved_facts.read(folder, LAYOUT_FILE, LayoutCosts)


def measure(
    recipe: Recipe, batches: dict[str, list[dict]], pad_shares: dict[str, float], precision: str
) -> LayoutCosts | None:
    """Time each layout's collated ``batches`` (``BATCHES`` of its epoch, from data/layout.py; module
    docstring); None (logged) where they cannot be timed here. ``pad_shares``: each layout's, over its epoch."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        log.info(
            "data.packing auto: %s processes would time apart; choosing by padding", os.environ["WORLD_SIZE"]
        )
        return None
    from qlora_kit.memory.cut_model import release
    from qlora_kit.memory.shapes import load_config

    try:
        return _time_layouts(recipe, load_config(recipe), batches, pad_shares, precision)
    except Exception as exc:  # a foreign model's code that cannot be built or run here: choose by padding
        log.info("data.packing auto: timing the layouts failed (%s); choosing by padding", exc)
        return None
    finally:
        release()  # the cut model's memory, before the run's model loads


def _time_layouts(
    recipe: Recipe, config, batches: dict[str, list[dict]], pad_shares: dict[str, float], precision: str
) -> LayoutCosts:
    from qlora_kit.memory.cut_model import LAYERS, cut_model
    from qlora_kit.memory.loss_head import final_hidden_states
    from qlora_kit.memory.tracing import layer_types

    memory = recipe.memory
    if not table.policy(memory.checkpointing).layer:  # auto and per-layer plans: as full
        memory = memory.model_copy(update={"checkpointing": table.FULL, "layer_policies": None})
    with cut_model(recipe, config, memory, precision) as cut:

        def on_device(inputs: dict) -> dict:
            return {k: v.to(cut.device) if torch.is_tensor(v) else v for k, v in inputs.items()}

        timed = {name: [on_device(inputs) for inputs in laid] for name, laid in batches.items()}
        positions = {name: sum(b["input_ids"].numel() for b in batches) for name, batches in timed.items()}

        def seconds(batches: list[dict]) -> float:
            cut.synchronize()
            start = cut.clock()
            for inputs in batches:
                with cut.autocast:
                    hidden = final_hidden_states(cut.peft_model, inputs, cut.base)
                hidden.float().square().mean().backward()
            cut.synchronize()
            return cut.clock() - start

        rounds: dict[str, list[float]] = {name: [] for name in timed}
        for round_index in range(ROUNDS + 1):  # interleaved: a slow spell of a shared machine hits them all
            for name, batches in timed.items():
                spent = seconds(batches)
                if round_index:
                    rounds[name].append(spent / positions[name])
        device = cut.device.type
    per_position = {name: statistics.median(values) for name, values in rounds.items()}
    layers = min(LAYERS, len(layer_types(config)))
    source = (
        f"measured on {device}{'' if device == 'cuda' else ' (one thread)'} through {layers} layers, "
        f"{BATCHES} batches a layout"
    )
    return LayoutCosts(per_position, {name: pad_shares[name] for name in per_position}, source)
