"""A model's train/eval mode around inference: evaluation, generation and the reference's log-probabilities.

``in_eval_mode(lm)`` turns dropout (and any other train-only behaviour) off for the block and gives the
module back the mode it had, even when the block raises: after a training run's own evaluation, or
between training steps, the model goes on training as it was.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def in_eval_mode(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``module`` in eval mode for the block, then in the mode it was in before."""
    was_training = module.training
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)
