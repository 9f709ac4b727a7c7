"""Experiment trackers (``train.report_to``): tensorboard by default, Weights & Biases, MLflow, trackio.

Each is transformers' own integration callback, created here rather than by the Trainer from
``report_to`` so that it sits after qlora_kit's memory and throughput callbacks and receives their
figures (the Trainer puts its integrations before every callback it is given). Besides what the
integrations log (the Trainer's arguments, the model config, every logged metric), ``LogRecipe`` logs
the run's resolved recipe to each, under the run name (``train.run_name``, by default the output
folder's name) and project (``train.project``).

Each tracker but tensorboard is an optional extra (``pip install 'qlora-kit[wandb]'``); a recipe naming
one that is not installed is refused at validation. Where a tracker keeps its runs is its own setting
(WANDB_MODE=offline, MLFLOW_TRACKING_URI, TRACKIO_DIR, ...), with two defaults filled in when unset:
the project, and MLflow's store, a folder ``mlruns/`` in the output folder (MLflow 3 would otherwise
open ``mlflow.db`` in the working directory, which needs the full mlflow package).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

# report_to name -> (the module it needs, transformers' callback class name)
TRACKERS = {
    "tensorboard": ("tensorboard", "TensorBoardCallback"),
    "wandb": ("wandb", "WandbCallback"),
    "mlflow": ("mlflow", "MLflowCallback"),
    "trackio": ("trackio", "TrackioCallback"),
}


def check_installed(report_to: list[str]) -> str | None:
    """The one line for the first tracker whose package is missing, or None."""
    for name in report_to:
        if not _installed(TRACKERS[name][0]):
            return f"train.report_to: {name} is not installed (pip install 'qlora-kit[{name}]')"
    return None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules[module] is None: its import is disabled
        return False


def tracker_callbacks(recipe: Recipe, output_dir: Path) -> list[TrainerCallback]:
    """The recipe's trackers, then the callback that logs the resolved recipe to them."""
    from transformers import integrations

    chosen = recipe.train.report_to
    if not chosen:
        return []
    _default_env("WANDB_PROJECT", recipe.train.project)
    _default_env("MLFLOW_EXPERIMENT_NAME", recipe.train.project)
    if "mlflow" in chosen and _default_env("MLFLOW_TRACKING_URI", (output_dir / "mlruns").resolve().as_uri()):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses file stores without it
    callbacks = []
    for name in chosen:
        callback = getattr(integrations, TRACKERS[name][1])()
        if name == "tensorboard":
            # a fixed folder in the run's folder; its writer is created at the start of training
            callback.logging_dir = str(output_dir / "tensorboard")
        callbacks.append(callback)
    return [*callbacks, LogRecipe(recipe.to_yaml(), recipe.resolved_values(), callbacks)]


_DEFAULTED: dict[str, str] = {}  # environment variables qlora_kit filled in, with the value it gave


def _default_env(name: str, value: str) -> bool:
    """Set an environment variable the integrations read, unless the user set it; True if set here. A
    later run in the same process (a notebook) gets its own value, not the first run's."""
    if name in os.environ and _DEFAULTED.get(name) != os.environ[name]:
        return False
    os.environ[name] = _DEFAULTED[name] = value
    return True


class LogRecipe(TrainerCallback):
    """Logs the resolved recipe to every tracker at the start of training (after their own setup, which
    runs in their on_train_begin, earlier in the list), on the main process."""

    def __init__(self, text: str, values: dict[str, Any], trackers: list[TrainerCallback]) -> None:
        self.text, self.values, self.trackers = text, values, trackers

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        if not state.is_world_process_zero:
            return
        for tracker in self.trackers:
            name = type(tracker).__name__
            if name == "TensorBoardCallback" and tracker.tb_writer is not None:
                tracker.tb_writer.add_text("recipe", f"```yaml\n{self.text}```")
            elif name == "WandbCallback" and tracker._wandb.run is not None:
                tracker._wandb.config.update({"recipe": self.values}, allow_val_change=True)
            elif name == "MLflowCallback" and tracker._ml_flow.active_run() is not None:
                tracker._ml_flow.log_dict(self.values, "recipe.json")
            elif name == "TrackioCallback":
                tracker._trackio.config.update({"recipe": self.values}, allow_val_change=True)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        # transformers' wandb integration leaves its run open: a second run in this process would log into it
        for tracker in self.trackers:
            wandb = getattr(tracker, "_wandb", None)
            if state.is_world_process_zero and wandb is not None and wandb.run is not None:
                wandb.finish()
