"""memory.chunked_loss auto (memory/loss_choice.py): full logits where the run's planned peak with them fits its
budget, the chunked head where it does not; either way the Trainer's loss is transformers' own."""

from __future__ import annotations

import logging

import pytest
import torch

from qlora_kit.memory.loss_choice import choose_head, planned_peak, with_head
from qlora_kit.memory.planner import GIB
from qlora_kit.training.pipeline import build

from .conftest import quick_recipe


def trainer_loss_and_transformers_loss(trainer) -> tuple[float, float, int]:
    """The Trainer's loss on its first batch, transformers' own loss (the model's forward with labels) on
    it, and the batch's trained positions."""
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    model = trainer.model.eval()  # no dropout: the two forward passes see the same weights
    with torch.no_grad():
        ours = trainer.compute_loss(model, inputs)
        theirs = model(**inputs).loss
    return float(ours), float(theirs), int((inputs["labels"][:, 1:] != -100).sum())


@pytest.mark.slow  # builds and steps the demo twice (~2 s)
def test_two_budgets_give_each_head_and_transformers_loss(tmp_path, caplog):
    # Where the head sets the peak: no checkpointing, and chunks smaller than the batch's 1,024 tokens (under
    # full checkpointing the demo's peak is a layer's recompute, after the head's backward has freed what
    # the head kept, so both heads plan the same peak and auto keeps full logits)
    head_matters = {"memory.checkpointing": "none", "memory.loss_chunk_tokens": 64}
    recipe = quick_recipe(tmp_path / "plan", **head_matters)
    assert recipe.memory.chunked_loss == "auto"  # the default
    full = planned_peak(with_head(recipe, False), "cpu", {}) / GIB
    chunked = planned_peak(with_head(recipe, True), "cpu", {}) / GIB
    assert chunked < full  # the demo's vocabulary makes full logits the larger plan
    roomy, tight = full * 1.5, (full + chunked) / 2
    assert not choose_head(recipe, "cpu", roomy).chunked
    assert choose_head(recipe, "cpu", tight).chunked
    for budget, chunked_head in ((roomy, False), (tight, True)):
        run = quick_recipe(tmp_path / f"{budget:.6f}", **head_matters, **{"memory.budget_gb": budget})
        with caplog.at_level(logging.INFO, logger="qlora_kit.memory.loss_choice"):
            trainer = build(run, tmp_path / f"out-{budget:.6f}").trainer
        said = "chunked" if chunked_head else "full logits"
        assert f"memory.chunked_loss auto: {said}" in caplog.text
        assert (trainer.chunk_tokens is not None) is chunked_head
        ours, theirs, trained = trainer_loss_and_transformers_loss(trainer)
        hidden = trainer.model.config.hidden_size
        # float32 throughout (the demo computes in fp32 on the CPU): the head's dot products of hidden values
        # and the mean over trained positions, summed in another order (chunks): first-order bound
        tolerance = (hidden + trained) * torch.finfo(torch.float32).eps
        assert abs(ours - theirs) <= tolerance * abs(theirs), (ours, theirs, tolerance)
        caplog.clear()


def test_a_set_head_is_kept_whatever_the_budget(tmp_path):
    for chunked in (True, False):
        recipe = quick_recipe(tmp_path, **{"memory.chunked_loss": chunked})
        choice = choose_head(recipe, "cpu", 1e-6)
        assert choice.chunked is chunked and choice.chunk_tokens == recipe.memory.loss_chunk_tokens


def test_planning_leaves_the_runs_random_state_as_it_was(tmp_path, monkeypatch):
    """The pipeline plans (this head, checkpointing auto) after ``set_seed`` and before LoRA's A is drawn:
    a plan that draws from the run's stream gives a run that plans other weights than one that does not,
    and a resumed run other weights than its first part (the trace is cached per process)."""
    from qlora_kit.memory import tracing
    from qlora_kit.memory.cut_model import cut_model
    from qlora_kit.memory.shapes import load_config

    monkeypatch.setattr(tracing, "_TRACED", {})  # a trace of its own, not one an earlier test cached
    recipe = quick_recipe(tmp_path)
    before = torch.random.get_rng_state()
    choose_head(recipe, "cpu")
    assert torch.equal(before, torch.random.get_rng_state()), "the trace drew from the run's stream"
    with cut_model(recipe, load_config(recipe), recipe.memory, "no"):  # what auto's timings build
        pass
    assert torch.equal(before, torch.random.get_rng_state()), "the cut model drew from the run's stream"
