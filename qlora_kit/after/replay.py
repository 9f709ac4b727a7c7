"""Readers made of figures already computed, for the parity report (after/export.py): the floor model's
figures replayed, and an export's reader whose figures are kept as it gives them, so that comparing it
against the trained model and against its floor reads each prompt once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from qlora_kit.after.parity import Reference


class ReplayReader:
    """A reference's figures as a reader (the floor model's, computed once): no served prompt of its own."""

    def __init__(self, reference: Reference, name: str) -> None:
        self.name = name
        # keyed by the images too: two image rows may ask the same words of different pictures
        files = reference.images or [()] * len(reference.prompts)
        self._logits = {
            (tuple(p), tuple(a), f): x
            for p, a, x, f in zip(reference.prompts, reference.answers, reference.logits, files, strict=True)
        }
        self._greedy = {
            (tuple(p), f): g for p, g, f in zip(reference.prompts, reference.greedy, files, strict=True)
        }

    def answer_logits(self, prompt: list[int], answer: list[int], images: tuple = ()) -> torch.Tensor:
        return self._logits[(tuple(prompt), tuple(answer), tuple(images))]

    def greedy(self, prompt: list[int], count: int, images: tuple = ()) -> list[int]:
        return self._greedy[(tuple(prompt), tuple(images))][:count]


class ReadOnce:
    """A reader whose figures are kept as it gives them: an export compared against the trained model
    and against its floor reads each prompt once, not twice. Its served prompts and template (a real
    reader's) pass through."""

    def __init__(self, reader) -> None:
        self._reader, self.name = reader, reader.name
        self._logits: dict[tuple, torch.Tensor] = {}
        self._greedy: dict[tuple, list[int]] = {}

    def answer_logits(self, prompt: list[int], answer: list[int], **images) -> torch.Tensor:
        key = (tuple(prompt), tuple(answer), tuple(images.get("images", ())))
        if key not in self._logits:
            self._logits[key] = self._reader.answer_logits(prompt, answer, **images)
        return self._logits[key]

    def greedy(self, prompt: list[int], count: int, **images) -> list[int]:
        key = (tuple(prompt), count, tuple(images.get("images", ())))
        if key not in self._greedy:
            self._greedy[key] = self._reader.greedy(prompt, count, **images)
        return self._greedy[key]

    def __getattr__(self, name: str):  # served_ids, render: only where the reader has them
        return getattr(self._reader, name)
