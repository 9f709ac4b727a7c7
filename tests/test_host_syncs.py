"""The step reads the device (a host sync on a GPU) once: the guard's flags. Every read of a tensor's value
on the host in a training step is counted (``Tensor.item``, ``tolist``, ``bool``, ``float``, ``int``,
``numpy``, ``cpu``: what waits for a GPU's queue to drain) by a torch function mode open from the
Trainer's ``on_step_begin`` to its ``on_step_end``, and named by where it was called from."""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import TrainerCallback

from qlora_kit import train
from tests.conftest import quick_recipe

pytestmark = pytest.mark.slow  # trains a few steps

HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
}
# transformers' own read, in every forward of packed rows: whether position_ids hold several sequences
# (masking_utils.find_packed_sequence_indices: ``(mask[:, -1] == 0).all()`` in an ``if``); not ours to cut
LIBRARY_READS = Counter({"masking_utils.py:find_packed_sequence_indices": 1})


class HostReads(TorchFunctionMode):
    """Each host read of a tensor, named by the function that asked (file:function)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            where = traceback.extract_stack()[-2]
            self.sites[f"{where.filename.rsplit('/', 1)[-1]}:{where.name}"] += 1
        return func(*args, **(kwargs or {}))


class CountPerStep(TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[Counter[str]] = []
        self.mode: HostReads | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.mode = HostReads()
        self.mode.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        self.mode.__exit__(None, None, None)
        self.steps.append(self.mode.sites)


def test_a_training_step_reads_the_device_once_the_guards_flags(tmp_path):
    counter = CountPerStep()
    # logging every 100 steps: no step here logs (a logging step reads the loss and the token count)
    train(
        quick_recipe(tmp_path / "out", **{"train.max_steps": 6, "train.logging_steps": 100}),
        callbacks=[counter],
    )
    assert len(counter.steps) == 6
    expected = Counter({"guards.py:_read_flags": 1}) + LIBRARY_READS
    # the first steps also read the dead-gradient check (B at step 1, each A once its B has moved)
    for step in counter.steps:
        dead_check = Counter({"guards.py:_stack_any": step["guards.py:_stack_any"]})
        assert step - dead_check == expected, counter.steps
    assert counter.steps[-1] == expected, counter.steps
