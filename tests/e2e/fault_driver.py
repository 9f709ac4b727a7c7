"""Runs a real training run in this process and kills it (SIGKILL) at a chosen point, for the fault tests.

    python tests/e2e/fault_driver.py RECIPE OUTPUT_DIR step:K     # right after optimizer step K
    python tests/e2e/fault_driver.py RECIPE OUTPUT_DIR save:K     # half-way through writing checkpoint-K
    python tests/e2e/fault_driver.py RECIPE OUTPUT_DIR final      # half-way through moving the final files
    python tests/e2e/fault_driver.py --cases CASES.json           # several runs, each its own process

``--cases`` reads a list of ``{"recipe", "output_dir", "where", "log"}`` and runs each case in a child
forked from this process after its imports (torch, transformers, peft: ~7 s of CPU a process, most of a
short killed run's cost), one after another: each run is still a process of its own, killed by a real
SIGKILL, its output (file descriptors 1 and 2) in ``log``. It prints ``{output_dir: exit code}`` as JSON,
the code as subprocess reports it (-9 for a SIGKILL).

Only this test harness patches anything, to choose the moment; the code that runs is the real one.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path

import torch
from transformers import TrainerCallback

import qlora_kit.training.pipeline
from qlora_kit import Recipe, train


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class KillAfterStep(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            die()


def kill_inside_checkpoint(step: int) -> None:
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        if f"checkpoint-{step}" in str(f) and str(f).endswith("optimizer.pt"):
            with open(f, "wb") as handle:
                handle.write(b"\0" * 1000)  # a torn file, then the process is gone
            die()
        return real_save(obj, f, *args, **kwargs)

    torch.save = save


def kill_inside_final_move() -> None:
    real_move = qlora_kit.training.pipeline.move_into_place

    def move(staged, destination, last=None):
        first = next(p for p in sorted(staged.iterdir()) if p.name != last)
        os.replace(first, destination / first.name)
        die()
        real_move(staged, destination, last)

    qlora_kit.training.pipeline.move_into_place = move


def run_until_killed(recipe_path: str, output_dir: str, where: str) -> None:
    recipe = Recipe.from_yaml(recipe_path, overrides={"train.output_dir": output_dir})
    callbacks = []
    kind, _, step = where.partition(":")
    if kind == "step":
        callbacks.append(KillAfterStep(int(step)))
    elif kind == "save":
        kill_inside_checkpoint(int(step))
    elif kind == "final":
        kill_inside_final_move()
    train(recipe, callbacks=callbacks)


def in_child(case: dict) -> int:
    """``case`` run in a forked child, its output in ``case["log"]``: the child's exit code (negative: the
    signal that ended it). A run that ends without its kill exits 0, one that fails 1 (its traceback in
    the log)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            log = os.open(case["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1), os.dup2(log, 2)
            run_until_killed(case["recipe"], case["output_dir"], case["where"])
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os._exit(code)  # the parent's atexit handlers and buffers are not the child's to run
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main() -> None:
    if sys.argv[1] == "--cases":
        cases = json.loads(Path(sys.argv[2]).read_text())
        print(json.dumps({case["output_dir"]: in_child(case) for case in cases}))
    else:
        run_until_killed(*sys.argv[1:4])


if __name__ == "__main__":
    main()
