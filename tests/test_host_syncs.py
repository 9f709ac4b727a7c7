"""What a production training step does, counted on one run without the tests' faults installed (as every
run outside the suite): it reads the device (a host sync on a GPU) once, the guard's flags, and it calls
nothing of the fault seam and, from its loss, nothing of the out-of-memory recovery.

Every read of a tensor's value on the host in a training step is counted (``Tensor.item``, ``tolist``,
``bool``, ``float``, ``int``, ``numpy``, ``cpu``: what waits for a GPU's queue to drain) by a torch
function mode open from the Trainer's ``on_step_begin`` to its ``on_step_end``, and named by where it was
called from; every Python function of qlora_kit the last step calls, with its caller, by ``sys.setprofile``
over that step."""

from __future__ import annotations

import sys
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
    """Host reads per step, and the qlora_kit functions the step numbered ``profiled`` calls:
    ``(module path under qlora_kit/, function, its caller's function)``."""

    def __init__(self, profiled: int) -> None:
        self.steps: list[Counter[str]] = []
        self.mode: HostReads | None = None
        self.profiled = profiled
        self.calls: set[tuple[str, str, str]] = set()

    def _profile(self, frame, event, arg):
        if event != "call" or PACKAGE not in frame.f_code.co_filename:
            return
        where = frame.f_code.co_filename.split(PACKAGE, 1)[1]
        self.calls.add((where, frame.f_code.co_name, frame.f_back.f_code.co_name if frame.f_back else ""))

    def on_step_begin(self, args, state, control, **kwargs):
        self.mode = HostReads()
        self.mode.__enter__()
        if state.global_step + 1 == self.profiled:
            sys.setprofile(self._profile)

    def on_step_end(self, args, state, control, **kwargs):
        sys.setprofile(None)
        self.mode.__exit__(None, None, None)
        self.steps.append(self.mode.sites)


PACKAGE = "/qlora_kit/"
STEPS = 6


@pytest.fixture(scope="module")
def production_steps(tmp_path_factory) -> CountPerStep:
    """6 steps of the demo without the suite's faults installed; the last one profiled."""
    from qlora_kit.memory import fault_seam

    counter = CountPerStep(profiled=STEPS)
    suites = fault_seam.install(None)
    try:
        # logging every 100 steps: no step here logs (a logging step reads the loss and the token count)
        train(
            quick_recipe(
                tmp_path_factory.mktemp("host_syncs") / "out",
                **{"train.max_steps": STEPS, "train.logging_steps": 100},
            ),
            callbacks=[counter],
        )
    finally:
        fault_seam.install(suites)
    return counter


def test_a_training_step_reads_the_device_once_the_guards_flags(production_steps):
    counter = production_steps
    assert len(counter.steps) == STEPS
    expected = Counter({"guards.py:_read_flags": 1}) + LIBRARY_READS
    # the first steps also read the dead-gradient check (B at step 1, each A once its B has moved)
    for step in counter.steps:
        dead_check = Counter({"guards.py:_stack_any": step["guards.py:_stack_any"]})
        assert step - dead_check == expected, counter.steps
    assert counter.steps[-1] == expected, counter.steps


def test_a_step_without_faults_calls_nothing_of_the_seam_and_its_loss_nothing_of_the_recovery(
    production_steps,
):
    """Without faults installed a step calls nothing of memory/fault_seam.py or of qlora_kit/testing/
    (the faults attach when the run is built, or not at all), and the trainer's ``compute_loss`` calls
    nothing of the out-of-memory recovery (the processes agree through a hook it sets on the model, only
    under several processes)."""
    calls = production_steps.calls
    called = {(where, name) for where, name, _ in calls}
    assert ("training/step/oom_recovery.py", "train") in called  # the profile saw the step
    seam = [c for c in called if c[0] == "memory/fault_seam.py" or c[0].startswith("testing/")]
    assert seam == [], seam
    from_loss = [c for c in calls if c[0].startswith("training/step/oom") and c[2] == "compute_loss"]
    assert from_loss == []
