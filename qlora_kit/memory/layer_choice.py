"""``checkpointing: auto``'s search: each decoder layer's policy so that the layers fit a byte budget at the
least recompute cost.

Each layer offers none, selective and full, each with the bytes it keeps for backward and what its
recompute costs (the planner's figures: traced bytes, counted costs, ``tracing.RecomputeCost``). This is
a multiple-choice knapsack; a dynamic programme over the layers keeps, for each amount of memory used,
the cheapest choice so far, pruned to the states no other beats on both memory and cost. Bytes are
counted in units of 1/(``RESOLUTION`` x layers) of the budget, rounded up per layer, so a choice found
always fits (it may miss one that fits within the last 1/``RESOLUTION`` of the budget).
"""

from __future__ import annotations

RESOLUTION = 256


def cheapest_fit(options: list[dict[str, tuple[int, float]]], budget: int) -> list[str] | None:
    """``options[i][policy] = (bytes, cost)`` for layer i; the policies, one per layer, of least total cost
    (then least bytes) whose bytes add up to at most ``budget``; None when nothing fits."""
    if budget < 0 or not options:
        return None if budget < 0 else []
    unit = max(1, budget // (RESOLUTION * len(options)))
    capacity = budget // unit
    states: dict[int, tuple[float, int, tuple[str, ...]]] = {0: (0.0, 0, ())}  # units -> (cost, bytes, picks)
    for layer in options:
        grown: dict[int, tuple[float, int, tuple[str, ...]]] = {}
        for used, (cost, nbytes, picks) in states.items():
            for policy, (layer_bytes, layer_cost) in layer.items():
                units = used + -(-layer_bytes // unit)
                if units > capacity:
                    continue
                candidate = (cost + layer_cost, nbytes + layer_bytes, (*picks, policy))
                if units not in grown or candidate[:2] < grown[units][:2]:
                    grown[units] = candidate
        states = _pareto(grown)
    if not states:
        return None
    return list(min(states.values(), key=lambda state: state[:2])[2])


def _pareto(states: dict[int, tuple[float, int, tuple[str, ...]]]) -> dict[int, tuple]:
    """Keep a state only if every state using less memory costs more: more memory at no less cost never helps."""
    kept, cheapest = {}, float("inf")
    for units in sorted(states):
        if states[units][0] < cheapest:
            kept[units] = states[units]
            cheapest = states[units][0]
    return kept
