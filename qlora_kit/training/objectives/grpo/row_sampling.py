"""Sampling each row of a batched ``generate`` call from a random stream of its own.

transformers samples a batch's next tokens with one ``torch.multinomial`` over the whole batch, from the
process's global random state: a row's completion depends on the rows sampled beside it, on how many
calls the batch is cut into and on the process that samples it. With ``grpo.seed_each_completion`` each
completion must be a function of what it is (the run's seed, the step, its prompt, its copy index:
``grpo.rollout_seed``), so that a split generation (an out-of-memory split, several processes) samples
exactly what one call would.

``RowSeededSampling`` is a logits processor that draws each row's next token by the Gumbel-max trick with
that row's own ``torch.Generator`` (argmax of the log-probabilities plus Gumbel noise is a sample of the
softmax) and leaves only that token's score finite, so the sampler transformers runs afterwards can only
pick it. transformers puts custom processors before its sampling warpers (temperature, top-k, top-p,
min-p), so this processor applies transformers' own warper classes, with the call's settings, before
drawing; the warpers that run after it find one finite score a row and keep it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.logits_process import LogitsProcessor


class RowSeededSampling(LogitsProcessor):
    """Row i's next token drawn from ``seeds[i]``'s generator; every other score set to -inf."""

    def __init__(self, seeds: list[int], generation_config, device: torch.device) -> None:
        self.generators = [torch.Generator(device=device).manual_seed(seed) for seed in seeds]
        self.warpers = warpers_of(generation_config)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.generators):
            raise RuntimeError(f"row-seeded sampling: {scores.shape[0]} rows, {len(self.generators)} seeds")
        warped = self.warpers(input_ids, scores).float()
        noise = torch.stack(
            [
                -torch.empty(scores.shape[-1], device=scores.device).exponential_(generator=g).log()
                for g in self.generators
            ]
        )
        chosen = (torch.log_softmax(warped, dim=-1) + noise).argmax(dim=-1, keepdim=True)
        only = torch.full_like(scores, -math.inf)
        return only.scatter_(1, chosen, 0.0)


def warpers_of(generation_config) -> LogitsProcessorList:
    """transformers' sampling warpers for ``generation_config``, in the order ``generate`` applies them."""
    config, warpers = generation_config, LogitsProcessorList()
    if config.temperature is not None and config.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(config.temperature))
    if config.top_k is not None and config.top_k != 0:
        warpers.append(TopKLogitsWarper(top_k=config.top_k))
    if config.top_p is not None and config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=config.top_p))
    if config.min_p is not None:
        warpers.append(MinPLogitsWarper(min_p=config.min_p))
    return warpers


@contextmanager
def rows_seeded(model, seeds: list[int], device: torch.device) -> Iterator[None]:
    """Every sampling ``model.generate`` call in the block draws row i from ``seeds[i]`` (one call at a
    time, with as many rows as seeds); the call's generation config keeps everything else (lengths, end of
    sequence, repetition penalty). transformers' own warpers, which run after this processor, find one
    finite score a row and keep it."""
    original = model.generate

    def generate(*args, generation_config, **kwargs):
        if generation_config.do_sample:
            sampler = RowSeededSampling(seeds, generation_config, device)
            kwargs["logits_processor"] = LogitsProcessorList(
                [*(kwargs.get("logits_processor") or []), sampler]
            )
        return original(*args, generation_config=generation_config, **kwargs)

    had_own = "generate" in vars(model)
    model.generate = generate  # this instance only, for the block
    # transformers' sampler still draws from the process's random state (its pick is forced): put it back,
    # so dropout and the checkpointed random state (resume) are what they would be without the option
    accelerators = [device] if device.type != "cpu" else []
    try:
        # the device's own type, cpu included: torch 2.7 cannot take device_type=None (torch.device(None))
        with torch.random.fork_rng(devices=accelerators, device_type=device.type):
            yield
    finally:
        if had_own:
            model.generate = original
        else:
            del model.generate
