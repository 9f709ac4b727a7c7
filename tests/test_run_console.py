"""The run console: figures as a person reads them, a live line on a terminal, plain lines elsewhere."""

import io
import re

from rich.console import Console
from transformers import TrainerControl, TrainerState, TrainingArguments

from qlora_kit.training.watch.run_console import RunConsole, figures, remaining

LOGS = {
    "loss": 0.51234,
    "learning_rate": 1e-3,
    "grad_norm": 0.4,
    "throughput/tokens_per_s": 3456.7,
    "memory/saved_mib": 1.5,
}


def events(terminal: bool) -> str:
    out = io.StringIO()
    console = Console(file=out, force_terminal=terminal, width=200, color_system=None)
    run_console = RunConsole(console)
    args, control = TrainingArguments(output_dir="unused", report_to="none"), TrainerControl()
    state = TrainerState(max_steps=10, global_step=0)
    run_console.on_train_begin(args, state, control)
    for step in range(1, 11):
        state.global_step = step
        run_console.on_step_end(args, state, control)
        if step % 5 == 0:
            run_console.on_log(args, state, control, logs=dict(LOGS))
            run_console.on_log(args, state, control, logs={"eval_loss": 0.25})
    run_console.on_train_end(args, state, control)
    return out.getvalue()


def test_figures_are_formatted_and_cuda_peaks_win_over_saved_bytes():
    assert figures(LOGS) == {
        "loss": "0.5123",
        "lr": "1.00e-03",
        "grad": "0.400",
        "tok/s": "3,457",
        "saved": "1.5 MiB",
    }
    assert figures(
        {"memory/peak_backward_gib": 3.2, "memory/peak_forward_gib": 2.0, "memory/saved_mib": 1.0}
    ) == {"peak": "3.20 GiB"}
    assert figures({"loss": 0.0, "reward": 0.4375}) == {"loss": "0.0000", "reward": "0.438"}  # GRPO's signal
    assert remaining(10.0, 5, 10) == "0:00:10" and remaining(1.0, 0, 10) == "?"


def test_without_a_terminal_each_log_is_one_plain_line():
    text = events(terminal=False)
    lines = text.splitlines()
    # half-way, the time left is an estimate from the wall clock: its form is fixed, its value is not
    first = "step 5/10  loss 0.5123  lr 1.00e-03  grad 0.400  tok/s 3,457  saved 1.5 MiB  left "
    assert lines[0].startswith(first) and re.fullmatch(r"\d+:\d\d:\d\d", lines[0][len(first) :]), lines[0]
    assert lines[1:] == [
        "step 5/10  eval loss 0.2500",
        "step 10/10  loss 0.5123  lr 1.00e-03  grad 0.400  tok/s 3,457  saved 1.5 MiB  eval 0.2500  left 0:00:00",
        "step 10/10  eval loss 0.2500",
    ]
    assert "\r" not in text and "\x1b" not in text


def test_on_a_terminal_one_live_line_shows_progress_and_the_latest_figures():
    text = events(terminal=True)
    assert "10/10" in text and "loss 0.5123" in text and "eval 0.2500" in text and "tok/s 3,457" in text
    assert "step 5/10" not in text  # no plain lines: the live display refreshes in place
