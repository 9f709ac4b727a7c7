"""Checkpointing policies: one ``PolicySpec`` per ``memory.checkpointing``, naming its traits.

Everything outside a policy's own mechanism module asks this table and never compares
``memory.checkpointing`` with a name: the recipe's validation (``recipe/memory.py``), the checkpointing code
(``memory/checkpointing.py``: how a policy expands per layer, the context function a layer runs under),
the tracer and the closed form (what a layer keeps for backward, what its recompute costs), the planner
(its candidates, their labels), ``auto`` and the timing of the layers (``layer_costs.py``).

A policy either is one decoder layer's (``layer``: none, selective, full; what ``memory.layer_policies``
may name) or expands to one per layer (every_n, per_layer), or is chosen by the planner (auto). A layer
policy says what a layer keeps for backward, in one of three kinds the tracer and the formula count:
``KEEPS_ALL`` (what autograd saves), ``KEEPS_INPUT`` (its input; backward recomputes it all) and
``KEEPS_EXPENSIVE`` (its input and its expensive ops' outputs; backward recomputes the cheap ops).
A policy that keeps something else needs its kind counted there too.

This table is standard library only, so it does not hold a mechanism: a policy whose layers run under a
torch checkpoint ``context_fn`` says so (``context_fn=True``) and memory/checkpointing.py's
``CONTEXT_FNS`` refers to the function. Adding a policy is one entry here plus its mechanism module (and
its line there, when it has a context) and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass

# How a policy becomes one policy per decoder layer
UNIFORM = "uniform"  # every layer runs it (a layer policy)
EVERY_N = "every_n"  # the dense policy on layers 0, n, 2n, ... and the light one between (memory.every_n)
LISTED = "listed"  # memory.layer_policies, one per layer
PLANNED = "planned"  # the planner chooses, before the run (memory.budget_gb; auto.resolve_checkpointing)

# What a layer under a layer policy keeps for backward (the tracer's and the formula's kinds)
KEEPS_ALL, KEEPS_INPUT, KEEPS_EXPENSIVE = "all", "input", "expensive"
KINDS = (KEEPS_ALL, KEEPS_INPUT, KEEPS_EXPENSIVE)

# The policies other policies are made of: the layer that keeps everything (the planner's baseline,
# every_n's light layers) and the one that keeps only its input (the unit of recompute cost, every_n's
# dense layers, the fallback of a budget nothing fits)
NONE, FULL = "none", "full"


@dataclass(frozen=True)
class PolicySpec:
    name: str
    expands: str  # UNIFORM, EVERY_N, LISTED or PLANNED
    keeps: str | None = None  # a layer policy's KEEPS_* (None for one that expands to others)
    recompute_share: float = 0.0  # its recompute against a full layer's, where the model is not traced
    context_fn: bool = False  # its layers run under torch checkpoint's context_fn (checkpointing.CONTEXT_FNS)
    candidate: bool = False  # the planner plans it for every recipe (the plan's rows, auto's choices)
    needs: str | None = None  # the memory field it cannot do without

    @property
    def layer(self) -> bool:
        """One decoder layer's policy (``memory.layer_policies`` may name it)."""
        return self.expands == UNIFORM

    @property
    def recomputes(self) -> bool:
        """A layer under it recomputes in backward (a layer policy that keeps less than everything)."""
        return self.keeps not in (None, KEEPS_ALL)


# In the planner's order, from the most memory to the least
POLICIES: dict[str, PolicySpec] = {
    spec.name: spec
    for spec in (
        PolicySpec(NONE, UNIFORM, KEEPS_ALL, candidate=True),
        PolicySpec("every_n", EVERY_N, candidate=True),
        PolicySpec(
            "selective",
            UNIFORM,
            KEEPS_EXPENSIVE,
            # the element-wise ops a selective layer replays are most of a QLoRA layer's forward time
            # on a CPU (benchmarks/memory.py's frontier)
            recompute_share=0.8,
            context_fn=True,
            candidate=True,
        ),
        PolicySpec(FULL, UNIFORM, KEEPS_INPUT, recompute_share=1.0, candidate=True),
        PolicySpec("per_layer", LISTED, needs="layer_policies"),
        PolicySpec("auto", PLANNED, needs="budget_gb"),
    )
}


def policy(name: str) -> PolicySpec:
    """The table's entry for ``memory.checkpointing`` (or a layer's policy) ``name``."""
    return POLICIES[name]


def names() -> list[str]:
    """Every policy ``memory.checkpointing`` accepts, in table order."""
    return list(POLICIES)


def layer_policies() -> list[str]:
    """The policies one decoder layer may run (``memory.layer_policies``), in table order."""
    return [name for name, spec in POLICIES.items() if spec.layer]


def recomputes(name: str) -> bool:
    """A layer under layer policy ``name`` recomputes in backward."""
    return POLICIES[name].recomputes


def planned(name: str) -> bool:
    """``memory.checkpointing`` ``name`` is chosen by the planner before a run (auto)."""
    return POLICIES[name].expands == PLANNED


def listed() -> str:
    """The policy that names each layer's own (per_layer): what a mix of layer policies is called."""
    return next(name for name, spec in POLICIES.items() if spec.expands == LISTED)


def every_n() -> str:
    """The policy that spaces its dense layers ``memory.every_n`` apart."""
    return next(name for name, spec in POLICIES.items() if spec.expands == EVERY_N)


def of_kind(keeps: str) -> str:
    """The first layer policy that keeps ``keeps`` (the tracer traces one of each kind)."""
    return next(name for name, spec in POLICIES.items() if spec.layer and spec.keeps == keeps)


def one_of(choices: list[str]) -> str:
    """Choices as pydantic writes a Literal's: ``'a', 'b' or 'c'``."""
    quoted = [repr(c) for c in choices]
    return quoted[0] if len(quoted) == 1 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
