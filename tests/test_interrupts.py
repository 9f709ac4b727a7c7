"""SIGTERM in a real run: the handler StopOnSignal installs finishes the step, checkpoints it and stops.

The signal is sent by the process to itself from a callback at the start of a step, so the real handler
runs at a known moment (the e2e fault tests send it from outside, at a moment they can only wait for).
"""

import os
import signal

import pytest
from transformers import TrainerCallback

from qlora_kit import train
from qlora_kit.errors import Interrupted

from .conftest import quick_recipe

pytestmark = pytest.mark.slow  # trains: the full suite runs it, the inner loop skips it


class SignalDuringStep(TrainerCallback):
    """Sends ``signum`` to this process at the start of optimizer step ``step``."""

    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), self.signum)


def test_sigterm_stops_after_its_step_with_that_steps_checkpoint(tmp_path):
    out = tmp_path / "out"
    recipe = quick_recipe(out, **{"train.max_steps": 6, "train.save_steps": 5, "train.logging_steps": 1})
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(
        Interrupted, match=r"stopped by SIGTERM after step 2; checkpoint .*checkpoint-2 written"
    ):
        train(recipe, callbacks=[SignalDuringStep(2, signal.SIGTERM)])
    assert signal.getsignal(signal.SIGTERM) is handler, "the run puts the previous handler back"
    # checkpoint-2 is the signal's (save_steps would first save at 5), and nothing after step 2 ran
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert not (out / "adapter_config.json").exists(), "an interrupted run never looks finished"
