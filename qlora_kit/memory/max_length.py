"""The longest sequence that fits: ``qlora-kit plan RECIPE --max-seq-len``.

For each way of keeping a long row's activations (checkpointing none, selective, full; full with offloaded
checkpoints; full with offload and the tiled MLP) the search finds the longest sequence, at micro-batch 1,
whose planned peak fits the room (``memory.budget_gb``, or the given GiB). A plan is traced at every length
it reports (``planner.plan``), but tracing a long row costs seconds, so the search does not bisect with
traces: at micro-batch 1 every kept byte and every transient grows linearly with the sequence (one row has
no padding mask; the chunked loss head's chunk is fixed; a quadratic kernel is refused, ``attention_fit``),
so two traced lengths give the line, the line gives the candidate, and the candidate is traced and, while
it does not fit, stepped down. Lengths are multiples of ``STEP`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from qlora_kit.memory.planner import GIB, PolicyPlan, plan
from qlora_kit.registries import checkpointing as table

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

STEP = 1024
# the two traced lengths the first line is drawn through: long enough that auto tiles are already several
PROBES = (16 * STEP, 32 * STEP)
MAX_TRIES = 6  # traced candidates after the probes (a secant search on peak(seq) = room)

# name -> the memory section's fields for it
WAYS: dict[str, dict] = {
    **{p: {"checkpointing": p, "offload_activations": False, "mlp_tiles": 1} for p in table.layer_policies()},
    f"{table.FULL} + offload": {"checkpointing": table.FULL, "offload_activations": True, "mlp_tiles": 1},
    f"{table.FULL} + offload + tiles": {
        "checkpointing": table.FULL,
        "offload_activations": True,
        "mlp_tiles": "auto",
    },
}


@dataclass
class LongestFit:
    way: str
    seq: int  # 0: not even the shortest probe fits
    device_peak: int  # the traced plan's peak at seq
    host: int  # offloaded checkpoints at seq
    activations: int


def planned_at(recipe: Recipe, fields: dict, seq: int, device: str) -> PolicyPlan:
    """The plan of one row of ``seq`` tokens with the memory ``fields`` of one way set."""
    # one long row: no packing (its block-diagonal mask grows with the square of the row)
    way = recipe.with_overrides({"data.packing": False, **{f"memory.{k}": v for k, v in fields.items()}})
    return plan(way, batch=1, seq=seq, device=device).chosen(way)


def longest_fit(recipe: Recipe, way: str, budget_gb: float, device: str = "cuda") -> LongestFit:
    """The longest multiple of ``STEP`` tokens that ``way`` fits in ``budget_gb`` at micro-batch 1: the
    last traced length that fits, with one ``STEP`` more traced and found not to."""
    fields, room = WAYS[way], budget_gb * GIB
    rows = {seq: planned_at(recipe, fields, seq, device) for seq in PROBES}
    for _ in range(MAX_TRIES):
        (short, low), (long, high) = sorted(rows.items())[-2:] if len(rows) == 2 else _nearest(rows, room)
        per_token = max((high.peak - low.peak) / (long - short), 1.0)
        seq = max(STEP, int(long + (room - high.peak) / per_token) // STEP * STEP)
        for candidate in (seq, seq + STEP):
            if candidate not in rows:
                rows[candidate] = planned_at(recipe, fields, candidate, device)
        if rows[seq].peak <= room < rows[seq + STEP].peak:
            break
    fitting = [seq for seq, row in rows.items() if row.peak <= room]
    if not fitting:
        row = rows[min(rows)]
        return LongestFit(way, 0, row.peak, row.host, row.activations)
    best = max(fitting)
    row = rows[best]
    return LongestFit(way, best, row.peak, row.host, row.activations)


def _nearest(rows: dict[int, PolicyPlan], room: float) -> list[tuple[int, PolicyPlan]]:
    """The two traced lengths that bracket the room most closely (the longest that fits, the shortest that
    does not), or the two nearest it on one side."""
    fits = sorted((s, r) for s, r in rows.items() if r.peak <= room)
    over = sorted((s, r) for s, r in rows.items() if r.peak > room)
    if fits and over:
        return [fits[-1], over[0]]
    return (fits or over)[-2:] if fits else over[:2]


def longest_fits(recipe: Recipe, budget_gb: float, device: str = "cuda") -> list[LongestFit]:
    return [longest_fit(recipe, way, budget_gb, device) for way in WAYS]
