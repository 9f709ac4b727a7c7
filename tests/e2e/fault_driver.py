"""Runs a real training run in this process and kills it (SIGKILL) at a chosen point, for the fault tests.

    python tests/e2e/fault_driver.py RECIPE OUTPUT_DIR step:K     # right after optimizer step K
    python tests/e2e/fault_driver.py RECIPE OUTPUT_DIR save:K     # half-way through writing checkpoint-K
    python tests/e2e/fault_driver.py RECIPE OUTPUT_DIR final      # half-way through moving the final files

Only this test harness patches anything, to choose the moment; the code that runs is the real one.
"""

from __future__ import annotations

import os
import signal
import sys

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


def main() -> None:
    recipe_path, output_dir, where = sys.argv[1:4]
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


if __name__ == "__main__":
    main()
