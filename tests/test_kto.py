"""train.objective kto: unpaired feedback (a prompt, one answer, a thumbs-up or -down) through the objective
table: the recipe's rules, its data, the planner's terms, and one short run end to end (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qlora_kit import Recipe
from qlora_kit.registries.objectives import OBJECTIVES

ROOT = Path(__file__).resolve().parents[1]
DEMO_KTO = ROOT / "recipes" / "demo-kto.yaml"


def kto_recipe(output_dir: Path | str = "out", **overrides) -> Recipe:
    values = {"train.output_dir": str(output_dir), "train.sample_prompts": 0}
    return Recipe.from_yaml(DEMO_KTO, overrides={**values, **overrides})


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"train": {"objective": "kto"}},
            "data.format: train.objective kto trains on answers labelled desirable or not: use feedback",
        ),
        (
            {"data": {"path": "builtin:demo-feedback", "format": "feedback"}},
            "train.objective: format feedback holds answers labelled desirable or not; set train.objective: kto",
        ),
        (
            {"train": {"objective": "kto"}, "data": {"format": "feedback", "packing": True}},
            "data.packing: not with train.objective kto",
        ),
        (
            {"train": {"objective": "kto"}, "data": {"format": "feedback"}, "lora": {"bias": "all"}},
            "lora.bias: all not with train.objective kto",
        ),
        ({"preference": {"beta": 0.5}}, "preference: only applies to train.objective: dpo or orpo or kto"),
    ],
)
def test_the_recipe_refuses_what_kto_cannot_do(values, message):
    with pytest.raises(ValueError, match=message):
        Recipe.from_dict(values)


def test_kto_rows_are_the_labelled_texts_trl_reads_shuffled_once(tokenizer):
    from qlora_kit.data.demo import demo_data_files
    from qlora_kit.training.objectives import kto

    prepared = kto.prepare(kto_recipe(), tokenizer)
    train = prepared.train
    assert train.column_names == ["prompt", "completion", "label"]
    shipped = [json.loads(line) for line in demo_data_files("demo-feedback")[0].read_text().splitlines()]
    assert sorted(map(json.dumps, train.to_list())) == sorted(map(json.dumps, shipped))
    assert train.to_list() != shipped  # shuffled: TRL reads them in order (its KL baseline)
    assert sum(train["label"]) == len(train) // 2  # each demo question: its right and a wrong answer
    assert prepared.val is not None and len(prepared.val) == 112
    assert prepared.reports[0].trained_tokens == sum(
        len(tokenizer(c)["input_ids"]) + 1 for c in train["completion"]
    )


def test_a_row_without_a_label_is_one_line_naming_the_field(tmp_path, tokenizer):
    from qlora_kit.errors import DataError
    from qlora_kit.training.objectives import kto

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    with pytest.raises(DataError, match="missing field 'label' for format 'feedback'"):
        kto.prepare(
            kto_recipe(**{"data.path": str(path), "data.val_fraction": 0.0, "train.eval_steps": None}),
            tokenizer,
        )
    path.write_text(json.dumps({"prompt": "p", "completion": "c", "label": "yes"}) + "\n")
    with pytest.raises(DataError, match="row 1: field 'label' must be true or false"):
        kto.prepare(
            kto_recipe(**{"data.path": str(path), "data.val_fraction": 0.0, "train.eval_steps": None}),
            tokenizer,
        )


@pytest.mark.slow  # traces a plan: the full suite runs it
def test_the_planner_counts_each_row_and_its_kl_twin():
    from qlora_kit.memory.planner import plan

    assert OBJECTIVES["kto"].sequences_per_row == 2
    recipe = kto_recipe(**{"train.micro_batch_size": 4})
    result = plan(recipe)
    assert result.batch == 8 and result.rollout == 0
    sft = plan(Recipe.from_dict({"train": {"micro_batch_size": 4}}))
    assert sft.batch == 4


@pytest.mark.slow
def test_kto_trains_from_a_recipe_and_reports_its_margins(tmp_path):
    """A few steps of the demo recipe on the tiny 4-bit base: TRL's reward figures reach metrics.jsonl, the
    console and show; eval scores the labelled answers against the reference (the base)."""
    from qlora_kit import evaluate, train
    from qlora_kit.training.run_folder.run_record import metric_rows, read_run

    overrides = {"train.max_steps": 6, "train.eval_steps": 3, "train.logging_steps": 2, "optimizer.lr": 5e-3}
    result = train(kto_recipe(tmp_path / "run", **overrides))
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("rewards/margins" in row for row in rows) and any("kl" in row for row in rows)
    assert any("eval_rewards/margins" in row for row in rows)
    summary = dict(metric_rows(read_run(result.output_dir).metrics))
    assert "reward margin, first -> last" in summary
    figures = evaluate(adapter_dir=result.output_dir, max_examples=16)
    assert {"reward_margin", "desirable_share", "preference_accuracy", "pairs"} <= set(figures)
    assert figures["pairs"] == 8 and figures["reward_margin"] > 0
    # the reference's share beside it is the base's own evaluation's (the reference policy is the base:
    # the adapter switched off, which runs the base layers alone), which the real model's KTO test reads
    base = evaluate(Recipe.from_yaml(result.output_dir / "recipe.yaml"), max_examples=16)
    assert figures["reference_desirable_share"] == base["desirable_share"], (figures, base)
    assert figures["desirable_share"] != base["desirable_share"]


def test_desirable_share_is_finite_where_the_answers_probabilities_underflow():
    """Answers of a few dozen tokens have summed log-probabilities of a few hundred: exp() of them is 0 in
    float32, and a share of probabilities 0/0 (issue 58: NaN on the real model's 20-token answers)."""
    import math

    import torch

    from qlora_kit.after.preference_eval import desirable_share

    good, bad = torch.tensor([-310.0, -400.0]), torch.tensor([-312.0])
    assert torch.exp(good).sum() == 0  # what the probabilities themselves give
    share = desirable_share(good, bad)
    assert share == pytest.approx(1 / (1 + math.exp(-2)), rel=1e-6)  # e^-310 / (e^-310 + e^-312)
    assert desirable_share(torch.tensor([-2.0]), torch.tensor([-2.0])) == pytest.approx(0.5)


def test_chat_feedback_rows_are_trls_conversations_and_train_what_sft_chat_trains(tmp_path, tokenizer):
    """TRL's conversational unpaired rows (prompt and completion as messages: KTO for chat models) reach
    TRL as conversations with data.system_prompt, and the ids the data report and eval count
    (feedback.token_ids, TRL's rule) are what format chat tokenizes for the same conversation, SFT's own
    rendering and masks (the oracle): the prompt untrained, the answer and its end-of-turn marker
    trained, no second EOS."""
    from qlora_kit.data import feedback, formats
    from qlora_kit.data.demo import demo_data_files
    from qlora_kit.registries.formats import IGNORE_INDEX
    from qlora_kit.training.objectives import kto

    shipped = [json.loads(line) for line in demo_data_files("demo-feedback")[0].read_text().splitlines()]
    chats = [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "completion": [{"role": "assistant", "content": r["completion"]}],
            "label": r["label"],
        }
        for r in shipped[:12]
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chats))
    values = {"data.path": str(path), "data.format": "feedback_chat", "data.system_prompt": "Be brief."}
    recipe = kto_recipe(**values, **{"data.val_fraction": 0.0, "train.eval_steps": None})
    rows = kto.prepare(recipe, tokenizer).train
    assert rows[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert rows[0]["completion"][0]["role"] == "assistant"
    for row in rows:
        prompt_ids, answer_ids = feedback.token_ids(row, tokenizer)
        messages = {"messages": [*row["prompt"], *row["completion"]]}
        sft = formats.tokenize(
            formats.render(messages, "chat", tokenizer, recipe.data), tokenizer, False, False
        )
        trained = [i for i, label in enumerate(sft["labels"]) if label != IGNORE_INDEX]
        assert prompt_ids + answer_ids == sft["input_ids"]
        assert trained[0] == len(prompt_ids)  # the prompt untrained in both
        kept = [sft["input_ids"][i] for i in trained]
        assert answer_ids[: len(kept)] == kept  # the answer and its end-of-turn marker, trained
        assert not tokenizer.decode(answer_ids[len(kept) :]).strip()  # then only the template's newline
        assert answer_ids.count(tokenizer.eos_token_id) <= 1
