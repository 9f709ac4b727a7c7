"""Merge's drift check on a mixture of experts: the positions where a router's choice flipped at a near-tie.

A router sends each position to its top-k experts by their scores. Where, in the trained model, the last expert
chosen and the first one left out nearly tie, the rounding a correct merge brings (drift_bounds' model) can swap
them, and from that layer on the position runs another expert: a KL far past the continuous rounding's
expectation, at a handful of positions, from a merge that is right. Seen on CI's machine (AMD EPYC, one thread a
process): the Qwen3 mixture's demo merged with 2 of 281 positions flipped at margins of 1e-4 and 1e-3 of a score
(RMS 0.16 and 0.28), KL 0.23 at one, every other position within 1e-6; the mean over every position 13 times its
bound. Such a position is left out of the check's means and counted, as top-1 agreement leaves out near-ties.

A flip stays in where the trained router was decided there: its margin between the dropped and the added
expert beyond what rounding can move the two scores. Rounding's reach on a router's score is drift_bounds'
model: the router's input carries the relative error of the products before it (``PASSES_PER_LAYER`` a
layer, then the layer's attention's two and the router's own), so a score moves by about that relative error
times the scores' RMS at the position; sqrt(SAFETY) covers what the model leaves out (SAFETY bounds a KL, a
square). A merge that is wrong (an expert's or a router's weights) moves positions whose routing was decided,
so it is judged there: the positions left out are the trained model's own near-ties, which no merge adds.
Only a position's first flip counts: the layers after it see another input and may flip for that reason.
"""

from __future__ import annotations

import torch

from qlora_kit.after import drift_bounds
from qlora_kit.memory.accounting import decoder_layers
from qlora_kit.model import moe_experts


class RouterChoices:
    """While registered on a model, records each router's scores (T, E) and chosen experts (T, k) per
    forward pass of a one-row batch, on the host; ``rows()`` gives them per forward pass. A dense model
    records nothing."""

    def __init__(self, lm: torch.nn.Module) -> None:
        base = lm.get_base_model() if hasattr(lm, "get_base_model") else lm
        found, self.experts = moe_experts.layer_routers(base, decoder_layers(base))
        self.layers = [index for index, _ in found]
        self.records: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in found]
        self.handles = [
            router.register_forward_hook(self._record(slot)) for slot, (_, router) in enumerate(found)
        ]

    def _record(self, slot: int):
        def hook(module, args, output) -> None:
            chosen = output[-1].reshape(-1, output[-1].shape[-1])  # the experts it sent each position to
            self.records[slot].append((self._scores(module, args, output), chosen.detach().cpu()))

        return hook

    def _scores(self, module, args, output) -> torch.Tensor | None:
        """The router's score for every expert: its first output where that is one dense score per expert
        (transformers' routers return their logits first), else its input through its weight (a router
        returning its chosen experts' weights scattered among zeros: gpt-oss'); None where neither is there,
        and its flips are then judged."""
        first = output[0] if isinstance(output, tuple) else None
        if first is not None and first.shape[-1] == self.experts and bool((first != 0).all()):
            return first.detach().reshape(-1, self.experts).float().cpu()
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if not isinstance(weight, torch.Tensor) or weight.shape[0] != self.experts:
            return None
        hidden = args[0].detach().reshape(-1, weight.shape[-1]).float()
        return torch.nn.functional.linear(
            hidden, weight.float(), None if bias is None else bias.float()
        ).cpu()

    def rows(self) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per forward pass, each router's (scores, chosen) in layer order."""
        return [list(row) for row in zip(*self.records, strict=True)] if self.records else []

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def reach(layer: int, roundoff: float) -> float:
    """How far, relative to the scores' RMS, rounding to ``roundoff`` (and float32's own) can move a router's
    score at decoder layer ``layer``."""
    variance = drift_bounds.rounding_variance(roundoff) + drift_bounds.rounding_variance(
        drift_bounds.unit_roundoff(torch.float32)
    )
    passes = drift_bounds.PASSES_PER_LAYER * layer + 3  # the layers before, attention's two, the router's own
    return (drift_bounds.SAFETY * variance * passes) ** 0.5


def near_tie_flips(
    trained: list[tuple[torch.Tensor, torch.Tensor]],
    merged: list[tuple[torch.Tensor, torch.Tensor]],
    layers: list[int],
    roundoff: float,
) -> torch.Tensor:
    """(T,) whether each position of one row first flipped its routing at a near-tie: ``trained`` and
    ``merged`` are the row's (scores, chosen) per router (RouterChoices.rows), ``layers`` their decoder layers."""
    positions = trained[0][1].shape[0] if trained else 0
    tie, flipped = torch.zeros(positions, dtype=torch.bool), torch.zeros(positions, dtype=torch.bool)
    for (scores, chosen), (_, chosen_merged), layer in zip(trained, merged, layers, strict=True):
        # the positions first flipped here: another set of experts (in any order), not flipped before
        changed = (chosen.sort(-1).values != chosen_merged.sort(-1).values).any(-1) & ~flipped
        for position in changed.nonzero().flatten().tolist():
            kept, now = set(chosen[position].tolist()), set(chosen_merged[position].tolist())
            flipped[position] = True
            if scores is None:  # no score to measure the margin by: judged
                continue
            dropped, added = sorted(kept - now), sorted(now - kept)
            margin = scores[position, dropped].min() - scores[position, added].max()
            allowed = 2 * reach(layer, roundoff) * scores[position].square().mean().sqrt()  # both scores move
            tie[position] = bool(margin <= allowed)
    return tie
