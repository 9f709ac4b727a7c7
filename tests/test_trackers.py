"""train.report_to without training: which callbacks a recipe gets, in which order, and the environment
defaults a tracker reads (tests/e2e/test_trackers.py runs each tracker for real, offline)."""

import os
from pathlib import Path

from transformers.integrations import MLflowCallback, TensorBoardCallback, WandbCallback

from qlora_kit import Recipe
from qlora_kit.training.watch import trackers


def test_the_recipes_trackers_come_in_its_order_with_the_recipe_logger_last(tmp_path, monkeypatch):
    for name in ("WANDB_PROJECT", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(trackers, "_DEFAULTED", {})
    recipe = Recipe.from_dict({"train": {"report_to": ["mlflow", "tensorboard", "wandb"], "project": "p1"}})
    callbacks = trackers.tracker_callbacks(recipe, tmp_path)
    kinds = [type(c) for c in callbacks]
    assert kinds == [MLflowCallback, TensorBoardCallback, WandbCallback, trackers.LogRecipe]
    assert callbacks[1].logging_dir == str(tmp_path / "tensorboard")
    assert callbacks[-1].values == recipe.resolved_values()
    assert os.environ["MLFLOW_TRACKING_URI"] == (tmp_path / "mlruns").as_uri()
    assert os.environ["WANDB_PROJECT"] == os.environ["MLFLOW_EXPERIMENT_NAME"] == "p1"
    # a second run in the same process gets its own defaults; what the user set is left alone
    monkeypatch.setenv("WANDB_PROJECT", "mine")
    other = Recipe.from_dict({"train": {"report_to": ["mlflow"], "project": "p2"}})
    trackers.tracker_callbacks(other, Path(tmp_path / "second"))
    assert os.environ["MLFLOW_TRACKING_URI"] == (tmp_path / "second" / "mlruns").as_uri()
    assert os.environ["MLFLOW_EXPERIMENT_NAME"] == "p2" and os.environ["WANDB_PROJECT"] == "mine"
    assert trackers.tracker_callbacks(Recipe.from_dict({"train": {"report_to": []}}), tmp_path) == []
