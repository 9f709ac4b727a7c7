"""train.objective orpo (issue 60's proof that an objective is one entry, its module and its tests): the
pairs DPO prepares, laid out as TRL's ORPOTrainer lays them out, and a short run with no reference policy."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from qlora_kit import Recipe

ROOT = Path(__file__).resolve().parents[1]
DEMO_DPO = ROOT / "recipes" / "demo-dpo.yaml"


def orpo_recipe(output_dir: Path | str = "out", **overrides) -> Recipe:
    values = {"train.objective": "orpo", "train.output_dir": str(output_dir), "train.sample_prompts": 0}
    return Recipe.from_yaml(DEMO_DPO, overrides={**values, **overrides})


def test_prepared_pairs_are_the_rows_trls_own_tokenizer_makes_of_their_texts(tokenizer):
    """TRL's ``ORPOTrainer.tokenize_row`` on each pair's texts is the oracle: qlora_kit's tokenized pair
    (the length policy and report DPO uses) must reach the loss as the same ids, masks and labels."""
    from trl.experimental.orpo import ORPOTrainer

    from qlora_kit.data import preference
    from qlora_kit.training.objectives import orpo

    recipe = orpo_recipe()
    prepared = orpo.prepare(recipe, tokenizer)
    trl_reader = SimpleNamespace(processing_class=tokenizer, is_encoder_decoder=False, max_length=10_000)
    trl_reader.build_tokenized_answer = functools.partial(ORPOTrainer.build_tokenized_answer, trl_reader)
    ours = functools.partial(orpo.GuardedORPOTrainer.tokenize_row, None)
    rows = prepared.val_rows
    for index in range(8):
        texts = preference.render_pair(rows[index], "alpaca", tokenizer, recipe.data)
        theirs = ORPOTrainer.tokenize_row(
            trl_reader, dict(zip(("prompt", "chosen", "rejected"), texts, strict=True))
        )
        row = ours(prepared.val[index])
        # TRL's old trainer prepends the BOS token itself; qlora_kit's rows (SFT's and DPO's too) hold the
        # special tokens the tokenizer adds, and the tiny model's adds none
        assert tokenizer(texts[0])["input_ids"][0] != tokenizer.bos_token_id
        assert {k: v[1:] for k, v in theirs.items() if k in row} == row


@pytest.mark.slow
def test_orpo_trains_through_the_guarded_step_and_reports_its_preferences(tmp_path):
    """A few steps on the tiny 4-bit base through the same step as every objective (its throughput count
    reads the forward's rows): TRL's reward figures in metrics.jsonl, the loss falls, eval scores the pairs."""
    from qlora_kit import evaluate, train

    overrides = {"train.max_steps": 6, "train.eval_steps": 3, "train.logging_steps": 2, "optimizer.lr": 5e-3}
    result = train(orpo_recipe(tmp_path / "run", **overrides))
    assert json.loads((result.output_dir / "adapter_config.json").read_text())["peft_type"] == "LORA"
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/accuracies" in row for row in rows)
    losses = [row["loss"] for row in rows if "loss" in row]
    assert losses[-1] < losses[0]
    figures = evaluate(adapter_dir=result.output_dir, max_examples=16)
    assert {"preference_accuracy", "likelihood_accuracy", "reward_margin"} <= set(figures)
