"""train.compile auto's two decisions, from the figures it measured on the run (compile_choice.unrepaid and
timed_choice): the decision moves with each measurement, none of them a constant. (That the run logs the
figures it measured: tests/test_compile_choice.py.)"""

from __future__ import annotations

import pytest

from qlora_kit.training.compile_choice import EXPECTED_COMPILES, LARGEST_SAVING, timed_choice, unrepaid


@pytest.mark.parametrize("least_compile_s", [0.05, 0.4, 8.0, 30.0])
def test_the_bound_refuses_exactly_where_the_eager_steps_cannot_repay_the_measured_compile(least_compile_s):
    # 100 steps whose largest saving is just under, then just over, the compiles at the measured cost
    threshold = EXPECTED_COMPILES * least_compile_s / (100 * LARGEST_SAVING)
    under = unrepaid(100, threshold * 0.99, least_compile_s)
    assert under is not None and f"at least {least_compile_s:.2f} s" in under
    assert unrepaid(100, threshold * 1.01, least_compile_s) is None


def test_the_bound_follows_the_measured_eager_step():
    # the same measured compile: a step ten times longer turns a refusal into a timed compile
    assert unrepaid(50, 0.01, 1.0) is not None
    assert unrepaid(50, 0.2, 1.0) is None


@pytest.mark.parametrize(
    ("steps", "eager_s", "compile_s", "compiled_s", "on"),
    [
        (1000, 0.30, 20.0, 0.20, True),  # 100 s saved against 40 s of compiles
        (300, 0.30, 20.0, 0.20, False),  # 30 s saved against the same 40 s
        (1000, 0.30, 60.0, 0.20, False),  # the same saving against 120 s
        (1000, 0.30, 20.0, 0.31, False),  # the compiled step is slower
    ],
)
def test_the_timed_decision_weighs_the_measured_saving_against_the_measured_compiles(
    steps, eager_s, compile_s, compiled_s, on
):
    choice = timed_choice(steps, eager_s, compile_s, compiled_s)
    assert choice.enabled is on, choice.reason
    saving = steps * (eager_s - compiled_s)
    assert choice.reason == (
        f"auto: {steps} steps x ({eager_s:.3f} s eager - {compiled_s:.3f} s compiled) = {saving:.1f} s "
        f"saved against {EXPECTED_COMPILES} compiles of {compile_s:.1f} s"
    )
