"""``memory.checkpointing: auto`` resolved from the plan: each decoder layer none, selective or full, so
that the predicted peak fits ``memory.budget_gb`` at the least recompute cost (``layer_choice``'s search,
priced by ``layer_costs``' measured costs or the trace's counted FLOPs), and never costlier than the
uniform policy (every_n among them) that fits the same budget.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qlora_kit.errors import RecipeError
from qlora_kit.memory import layer_costs
from qlora_kit.memory.layer_choice import cheapest_fit
from qlora_kit.memory.layer_costs import LayerCosts
from qlora_kit.memory.planner import GIB, Plan, PolicyPlan, plan, policy_name
from qlora_kit.registries import checkpointing as table

if TYPE_CHECKING:
    from qlora_kit.recipe.memory import MemorySection
    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)


def choose_layers(
    recipe: Recipe, budget_gb: float, the_plan: Plan | None = None, costs: LayerCosts | None = None
) -> tuple[PolicyPlan, str]:
    """``memory.checkpointing: auto``: each layer none, selective or full, so that the predicted peak fits
    ``budget_gb`` at the least recompute cost (``layer_choice.cheapest_fit``); (the plan's row, why).
    The cost of a layer's policy is ``costs``' (measured on the run's device, ``layer_costs``) when given,
    else the trace's counted FLOPs. Layer 0 is checkpointed whenever any layer is (its figures are traced
    so, as every_n's are). The uniform policies that fit (every_n among them) are candidates too: the
    search's choice replaces them only where it costs less, so auto never costs more than every_n."""
    the_plan = the_plan or plan(recipe)
    layers, budget = the_plan.shape.layers, budget_gb * GIB
    if the_plan.policies[0].peak <= budget:
        row = the_plan.policies[0]
        return row, f"predicted peak {row.peak / GIB:.2f} GiB <= budget {budget_gb:g} GiB with no recompute"
    uniform = {p: the_plan.activations(p) for p in table.layer_policies()}
    full = the_plan.policy_plan([table.FULL] * layers, table.FULL)

    def cost(policy: str, i: int) -> float:
        return costs.of(policy) if costs is not None else uniform[policy].recompute_cost[i]

    fixed = full.peak - sum(uniform[table.FULL].per_layer)  # weights, state, head, backward's spike
    options = [
        {p: (uniform[p].per_layer[i], cost(p, i)) for p in uniform if i or table.recomputes(p)}
        for i in range(layers)
    ]
    chosen = cheapest_fit(options, int(budget - fixed)) if the_plan.load_peak <= budget else None
    fitting = [r.layers for r in the_plan.policies[1:] if r.peak <= budget and r.policy != table.listed()]
    if chosen is None and not fitting:
        why = (
            f"nothing fits {budget_gb:g} GiB (full checkpointing needs {full.peak / GIB:.2f} GiB); using full"
        )
        return full, why
    total = {
        tuple(c): sum(cost(p, i) for i, p in enumerate(c)) for c in [*fitting, *([chosen] if chosen else [])]
    }
    # The uniform policy that fits at the least cost, unless the search's mix costs less (beyond rounding:
    # a tie keeps the uniform one)
    uniform_best = min(fitting, key=lambda c: total[tuple(c)], default=None)
    if uniform_best is not None and (
        chosen is None or total[tuple(chosen)] >= total[tuple(uniform_best)] * (1 - 1e-9)
    ):
        chosen = uniform_best
    name = chosen[0] if len(set(chosen)) == 1 else table.listed()
    row = next((r for r in the_plan.policies if r.layers == chosen), None) or the_plan.policy_plan(
        chosen, name
    )
    mix = ", ".join(f"{chosen.count(p)} {p}" for p in table.layer_policies() if p in chosen)
    if costs is None:
        recompute, source = f"{row.recompute_cost:.2f} layers' worth", "counted FLOPs"
    else:
        recompute, source = f"{total[tuple(chosen)] * 1000:.1f} ms a step", costs.source
    why = (
        f"predicted peak {row.peak / GIB:.2f} GiB <= budget {budget_gb:g} GiB with layers {mix} "
        f"(recompute {recompute}; {row.recompute_layers} of {layers} layers recomputed)"
        f"; none would need {the_plan.policies[0].peak / GIB:.2f} GiB; recompute costs: {source}"
    )
    return row, why


def choose_policy(
    recipe: Recipe, budget_gb: float, the_plan: Plan | None = None, costs: LayerCosts | None = None
) -> tuple[str, int, str]:
    """(policy, every_n, why) for ``memory.checkpointing: auto`` (``choose_layers``): a uniform policy's
    name (every_n with its n), or per_layer for a mix."""
    row, why = choose_layers(recipe, budget_gb, the_plan, costs)
    return *_policy_of(row, recipe), why


def _policy_of(row: PolicyPlan, recipe: Recipe) -> tuple[str, int]:
    """A plan row's label as the recipe's (checkpointing, every_n): "every_n=3" is every_n with n = 3."""
    name, _, n = row.policy.partition("=")
    if n:  # "every_n=3": every_n with n = 3 (planner.policy_name)
        return name, int(n)
    return row.policy, recipe.memory.every_n


def resolve_checkpointing(
    recipe: Recipe, checkpoint: Path | None = None, trained_share: float = 1.0
) -> MemorySection:
    return resolve_auto(recipe, checkpoint, trained_share)[0]  # the memory section alone


def resolve_auto(
    recipe: Recipe,
    checkpoint: Path | None = None,
    trained_share: float = 1.0,
    images_per_row: int | None = None,
    image_tokens: int | None = None,
) -> tuple[MemorySection, LayerCosts | None]:
    """The memory section with ``checkpointing: auto`` replaced by the planner's choice (logged, with why):
    a uniform policy, every_n, or per_layer with ``layer_policies``, planned with the data's
    ``trained_share`` (and a vision-language data's ``images_per_row`` and ``image_tokens``); and the measured costs it chose with (``layer_costs``: read back from
    ``checkpoint`` when a resumed run's has them, else measured here; None where FLOPs were counted),
    which every checkpoint keeps."""
    memory = recipe.memory
    experts_auto = memory.experts_on_host == "auto"
    if not table.planned(memory.checkpointing) and not experts_auto:
        return memory, None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # per GPU of this launch: under FSDP the weights and optimizer state are sharded over its processes
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    the_plan = plan(
        recipe,
        device=device,
        processes=processes,
        trained_share=trained_share,
        images_per_row=images_per_row,
        image_tokens=image_tokens,
    )
    if experts_auto:  # the plan resolved it (experts_plan.resolve); the run reads the choice
        memory = memory.model_copy(update={"experts_on_host": the_plan.experts_on_host})
        recipe = recipe.model_copy(update={"memory": memory})
        log.info(
            "memory.experts_on_host auto: %s (%s)",
            str(the_plan.experts_on_host).lower(),
            "the plan does not fit memory.budget_gb with them resident"
            if the_plan.experts_on_host
            else "the plan fits memory.budget_gb with them resident",
        )
        if not table.planned(memory.checkpointing):
            return memory, None
    if not the_plan.fitting(memory.budget_gb) and not memory.over_budget:
        smallest = min(the_plan.policies, key=lambda p: p.peak)
        raise RecipeError(
            f"memory.budget_gb: no checkpointing policy fits {memory.budget_gb:g} GiB (the smallest predicted "
            f"peak is {smallest.peak / GIB:.2f} GiB, with full checkpointing); lower train.micro_batch_size "
            f"({recipe.train.micro_batch_size}), data.max_seq_len ({recipe.data.max_seq_len}) or lora.rank "
            f"({recipe.lora.rank}), or set memory.over_budget: true to train anyway"
        )
    costs = None
    if the_plan.policies[0].peak > memory.budget_gb * GIB:  # something recomputes: what does it cost here?
        costs = layer_costs.read(checkpoint)
        if costs is None:
            costs = layer_costs.measure(
                recipe, the_plan.shape.config, the_plan.batch, the_plan.seq, the_plan.precision
            )
        else:
            log.info("checkpointing auto: the recompute costs of %s (%s)", checkpoint.name, costs.source)
    row, why = choose_layers(recipe, memory.budget_gb, the_plan, costs)
    policy, every_n = _policy_of(row, recipe)
    update = {
        "checkpointing": policy,
        "every_n": every_n,
        "layer_policies": row.layers if policy == table.listed() else None,
    }
    log.info("memory.checkpointing auto: %s (%s)", policy_name(policy, every_n), why)
    return memory.model_copy(update=update), costs
