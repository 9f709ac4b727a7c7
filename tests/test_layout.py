"""data.packing: auto picks the layout with the most real tokens a second, timed on the run's own batches
(memory/layout_costs.py), and the least padding where they are not timed; a resume chooses by the
figures its checkpoint keeps; group_by_length's order follows the seed and the epoch alone."""

import json
import logging

import pytest
import torch
from transformers.trainer_pt_utils import LengthGroupedSampler

from qlora_kit import Recipe
from qlora_kit.data import layout, prepare
from qlora_kit.memory import layout_costs
from qlora_kit.training.step.trainer import SeededLengthGroupedSampler


def shares_and_choice(recipe: Recipe, tokenizer):
    prepared = prepare.prepare_datasets(recipe.data, tokenizer, recipe.train.seed)
    shares = prepare.pad_shares(prepared, recipe.data, recipe.train.micro_batch_size, recipe.train.seed)
    data, laid_out = layout.resolve_layout(
        prepared, recipe.data, recipe.train.micro_batch_size, recipe.train.seed, layout.AUTO
    )
    return shares, data, prepared, laid_out


def chosen(data) -> str:
    return "packing" if data.packing is True else "group_by_length" if data.group_by_length else "padding"


def test_ties_go_to_the_simpler_layout_and_only_allowed_layouts_are_picked():
    assert layout.choose_layout({"padding": 0.1, "group_by_length": 0.1, "packing": 0.1}) == "padding"
    assert layout.choose_layout({"padding": 0.3, "group_by_length": 0.2, "packing": 0.05}) == "packing"
    assert (
        layout.choose_layout({"padding": 0.3, "group_by_length": 0.01, "packing": 0.2}) == "group_by_length"
    )
    assert (
        layout.choose_layout(
            {"padding": 0.3, "group_by_length": 0.01, "packing": 0.2}, ("padding", "packing")
        )
        == "packing"
    )
    shares = {"padding": 0.3, "group_by_length": 0.2, "packing": 0.05}
    assert layout.choose_layout(shares, ("padding", "group_by_length")) == "group_by_length"


def test_auto_picks_the_least_padding_on_the_demo_set(tokenizer):
    recipe = Recipe.from_dict({"data": {"max_seq_len": 64}, "train": {"micro_batch_size": 16}})
    assert recipe.data.packing == "auto"
    shares, data, prepared, laid_out = shares_and_choice(recipe, tokenizer)
    # by padding: packing 10.6% against group_by_length's 12.0% and padding's 29.7%
    assert chosen(data) == min(layout.AUTO, key=shares.get) == "packing"
    assert len(laid_out.train) < len(prepared.train)  # laid out packed


@pytest.mark.parametrize("spread", [False, True])
def test_auto_picks_the_least_padding_on_a_chat_set(tmp_path, tokenizer, spread):
    """Short chats of similar length, and chats of very different lengths (the issue's case: its
    short definitions padded 14.6%, grouped 0.1%, packed 27.3%)."""
    rows = []
    for i in range(64):
        words = 1 + (i * 7) % 20 if spread else 3 + i % 2
        answer = " ".join(["moo"] * words)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"Say moo {i}."},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = Recipe.from_dict(
        {"data": {"path": str(path), "format": "chat", "max_seq_len": 256}, "train": {"micro_batch_size": 4}}
    )
    shares, data, _, _ = shares_and_choice(recipe, tokenizer)
    assert chosen(data) == min(layout.AUTO, key=shares.get), shares
    if not spread:  # the case: similar short examples pack into unevenly filled rows
        assert chosen(data) != "packing" and shares["packing"] >= shares["padding"], shares


def test_packing_when_chosen_lays_the_sets_out_packed(tokenizer):
    recipe = Recipe.from_dict({"data": {"max_seq_len": 64}})
    prepared = prepare.prepare_datasets(recipe.data, tokenizer, recipe.train.seed)
    data, laid_out = layout.resolve_layout(prepared, recipe.data, 16, 0, ("packing",))
    assert data.packing is True and not data.group_by_length
    assert len(laid_out.train) < len(prepared.train) and "position_ids" in laid_out.train.column_names


def test_explicit_settings_are_left_as_they_are(tokenizer):
    for packing in (True, False):
        recipe = Recipe.from_dict({"data": {"packing": packing}})
        prepared = prepare.prepare_datasets(recipe.data, tokenizer, recipe.train.seed)
        data, _ = layout.resolve_layout(prepared, recipe.data, 16, 0, layout.AUTO)
        assert data is recipe.data


# the demo set's 11 micro-batches of 16 over 4 epochs: more than the 36 timing its 3 layouts runs
EPOCHS_TIMED = 4


@pytest.mark.slow
def test_a_run_builds_with_the_layout_auto_chose(tmp_path):
    """pipeline.build resolves auto before the preflight and the Trainer: the Trainer samples as chosen,
    and the figures it chose by reach the Trainer, which writes them into every checkpoint."""
    from qlora_kit.training.pipeline import build

    recipe = Recipe.from_dict(
        {
            "data": {"max_seq_len": 64},
            "train": {"micro_batch_size": 16, "epochs": EPOCHS_TIMED, "output_dir": str(tmp_path)},
        }
    )
    setup = build(recipe)
    picked = setup.run.layout_costs.fastest(layout.AUTO)  # timed on the demo set
    assert chosen(setup.recipe.data) == picked
    grouped = "group_by_length" if picked == "group_by_length" else "random"
    assert setup.trainer.args.train_sampling_strategy == grouped
    assert ("position_ids" in setup.trainer.train_dataset.column_names) == (picked == "packing")
    assert setup.trainer.layout_costs is setup.run.layout_costs


def test_timed_speeds_outrank_padding(tokenizer, caplog):
    """The layout with the most real tokens a second wins, even where it pads most (the real model's
    bf16 case: packing padded least and stepped slowest); without figures, the least padding."""
    recipe = Recipe.from_dict({"data": {"max_seq_len": 64}, "train": {"micro_batch_size": 16}})
    prepared = prepare.prepare_datasets(recipe.data, tokenizer, recipe.train.seed)
    shares = prepare.pad_shares(prepared, recipe.data, 16, 0)
    most_padding = max(layout.AUTO, key=shares.get)
    speeds = {name: 1.0 for name in layout.AUTO} | {most_padding: 1.3}
    with caplog.at_level(logging.INFO, logger="qlora_kit.data.layout"):
        data, _ = layout.resolve_layout(prepared, recipe.data, 16, 0, layout.AUTO, speeds, "timed here")
    assert chosen(data) == most_padding != min(layout.AUTO, key=shares.get)
    assert f"data.packing auto: {most_padding}, the most real tokens/s" in caplog.text
    assert "timed here" in caplog.text


def test_group_by_length_orders_each_epoch_from_the_seed_alone():
    """transformers' grouped order, drawn from seed + epoch whatever the global random state (which a
    resumed run reaches by another path), and a new order each epoch."""
    lengths = [(i * 37) % 101 + 1 for i in range(96)]
    sampler = SeededLengthGroupedSampler(8, lengths, seed=3)
    torch.manual_seed(0)
    first = list(sampler)
    torch.manual_seed(1)
    assert list(sampler) == first
    theirs = LengthGroupedSampler(8, lengths=lengths, generator=torch.Generator().manual_seed(3))
    assert list(theirs) == first  # transformers' own order, from the seed
    sampler.set_epoch(1)
    assert list(sampler) != first
    assert sorted(list(sampler)) == list(range(96))


@pytest.mark.slow
def test_a_run_times_the_layouts_and_a_resume_chooses_by_its_checkpoints_figures(
    tmp_path, tokenizer, monkeypatch
):
    """A fresh run times every layout on its own batches and lays its data out as the fastest; a resumed
    run takes the layout its checkpoint's figures name, and a checkpoint without figures the least
    padding, neither timing again (a second timing could differ by noise). Timing leaves the run's random
    state as it found it."""
    from qlora_kit.training.batch_layout import resolve as _resolve_layout

    recipe = Recipe.from_dict(
        {
            "data": {"max_seq_len": 64},
            "train": {"micro_batch_size": 16, "epochs": EPOCHS_TIMED, "output_dir": str(tmp_path)},
        }
    )
    prepared = prepare.prepare_datasets(recipe.data, tokenizer, recipe.train.seed)
    state = torch.get_rng_state()
    resolved, laid_out, costs = _resolve_layout(recipe, prepared, tokenizer, None, "no")
    assert torch.equal(torch.get_rng_state(), state)  # the run's random stream as it was
    assert costs is not None and costs.source.startswith("measured on cpu")
    assert set(costs.seconds_per_position) == set(layout.AUTO)
    assert all(s > 0 for s in costs.seconds_per_position.values())
    assert costs.pad_shares["packing"] < costs.pad_shares["padding"]
    assert chosen(resolved.data) == costs.fastest(layout.AUTO)
    assert ("position_ids" in laid_out.train.column_names) == (costs.fastest(layout.AUTO) == "packing")

    monkeypatch.setattr(layout_costs, "_time_layouts", lambda *a: pytest.fail("timed again on resume"))
    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    shares = prepare.pad_shares(prepared, recipe.data, 16, recipe.train.seed)
    for winner in layout.AUTO:
        seconds = {name: 1.0 if name == winner else 3.0 for name in layout.AUTO}
        layout_costs.write(checkpoint, layout_costs.LayoutCosts(seconds, shares, "measured before"))
        assert layout_costs.read(checkpoint).fastest(layout.AUTO) == winner
        resumed, _, figures = _resolve_layout(recipe, prepared, tokenizer, checkpoint, "no")
        assert chosen(resumed.data) == winner and figures.source == "measured before"
    (checkpoint / layout_costs.LAYOUT_FILE).unlink()
    resumed, _, figures = _resolve_layout(recipe, prepared, tokenizer, checkpoint, "no")
    assert figures is None and chosen(resumed.data) == min(layout.AUTO, key=shares.get)


def test_a_run_too_short_to_repay_the_timing_chooses_by_padding(tmp_path, tokenizer, monkeypatch, caplog):
    """Timing runs (ROUNDS + 1) x layouts x BATCHES micro-batches through the cut model (the tiny Llama: 4
    layers, all of them): a run that trains
    fewer (here 35 against 36) cannot repay it whatever the fastest layout saves, and chooses by padding,
    untimed; one more planned micro-batch and it times (red with the bound made inclusive)."""
    from qlora_kit.training.batch_layout import resolve as _resolve_layout

    recipe = Recipe.from_dict(
        {"data": {"max_seq_len": 64}, "train": {"micro_batch_size": 16, "max_steps": 35}}
    )
    prepared = prepare.prepare_datasets(recipe.data, tokenizer, recipe.train.seed)
    assert layout_costs.timed_micro_batches(len(layout.AUTO), 4) == 36  # 4 rounds x 3 layouts x 3
    monkeypatch.setattr(
        layout_costs, "_time_layouts", lambda *a: pytest.fail("timed a run too short to repay it")
    )
    with caplog.at_level(logging.INFO, logger="qlora_kit.training.batch_layout"):
        resolved, _, figures = _resolve_layout(recipe, prepared, tokenizer, None, "no")
    shares = prepare.pad_shares(prepared, recipe.data, 16, recipe.train.seed)
    assert figures is None and chosen(resolved.data) == min(layout.AUTO, key=shares.get)
    assert "35 planned micro-batches, fewer than the 36 timing the layouts runs" in caplog.text
    timed = []
    monkeypatch.setattr(layout_costs, "_time_layouts", lambda *a: timed.append(a) or None)
    longer = recipe.model_copy(update={"train": recipe.train.model_copy(update={"max_steps": 36})})
    _resolve_layout(longer, prepared, tokenizer, None, "no")
    assert len(timed) == 1
