"""Preference pairs (train.objective dpo): the recipe's rules, the pairs' tokens, the length policy and bad rows."""

import json
import re

import pytest

from qlora_kit import Recipe, RecipeError
from qlora_kit.data import demo, prepare
from qlora_kit.data.preference import alpaca_prompt
from qlora_kit.errors import DataError
from qlora_kit.recipe.preference import PreferenceSection

from .conftest import write

PAIRS = [
    {"prompt": "What color is a lime? ", "chosen": "green", "rejected": "red"},
    {"prompt": "Capital of Peru? ", "chosen": "Lima", "rejected": "Rome"},
]
CHAT_PAIRS = [
    {
        "prompt": [{"role": "system", "content": "One word."}, {"role": "user", "content": "Color of snow?"}],
        "chosen": [{"role": "assistant", "content": "white"}],
        "rejected": "black",
    }
]


def dpo_recipe(path, fmt="preference", **extra):
    values = {"train": {"objective": "dpo"}, "data": {"path": str(path), "format": fmt}}
    for key, value in extra.items():
        section, field = key.split(".")
        values.setdefault(section, {})[field] = value
    return Recipe.from_dict(values)


def pairs_of(recipe, tokenizer):
    return prepare.prepare_datasets(
        recipe.data, tokenizer, seed=0, max_prompt_len=recipe.preference.max_prompt_len
    )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"train": {"objective": "dpo"}}, "data.format: train.objective dpo trains on preference pairs"),
        ({"data": {"format": "preference"}}, "train.objective: format preference holds preference pairs"),
        ({"preference": {"beta": 0.5}}, "preference: only applies to train.objective: dpo"),
        (
            {"train": {"objective": "dpo"}, "data": {"format": "preference", "packing": True}},
            "data.packing: not with train.objective dpo",
        ),
        (
            {
                "train": {"objective": "dpo"},
                "data": {"format": "preference"},
                "preference": {"label_smoothing": 0.1},
            },
            "preference.label_smoothing: the sigmoid loss ignores it",
        ),
        (
            {
                "train": {"objective": "dpo"},
                "data": {"format": "preference"},
                "preference": {"loss_type": "exo_pair"},
            },
            "preference.label_smoothing: exo_pair needs it above 0",
        ),
        (
            {"train": {"objective": "dpo"}, "data": {"format": "preference", "group_by_length": True}},
            "data.group_by_length: not with train.objective dpo",
        ),
        (
            {"train": {"objective": "dpo"}, "data": {"format": "preference"}, "lora": {"bias": "all"}},
            "lora.bias: all not with train.objective dpo",
        ),
        (
            {
                "train": {"objective": "dpo", "fsdp": True},
                "data": {"format": "preference"},
                "quant": {"quant_storage": "bfloat16"},
                "optimizer": {"name": "adamw_torch"},
            },
            "train.fsdp: not with train.objective dpo",
        ),
    ],
)
def test_impossible_dpo_recipes_are_one_line_naming_the_field(values, message):
    with pytest.raises(RecipeError, match=re.escape(message)):
        Recipe.from_dict(values)


def test_a_dpo_recipe_is_unpacked_by_default_and_saved_recipes_load_back():
    dpo = Recipe.from_dict(
        {"train": {"objective": "dpo"}, "data": {"format": "preference"}, "preference": {"beta": 0.25}}
    )
    # auto never packs pairs (the run resolves it to padding: training/pipeline._resolve_layout)
    assert dpo.data.packing == "auto" and not dpo.data.packs and dpo.preference.beta == 0.25
    assert Recipe.from_dict(dpo.resolved_values()) == dpo
    sft = Recipe()
    assert sft.resolved_values()["preference"] == PreferenceSection().model_dump()  # its defaults load back
    assert Recipe.from_dict(sft.resolved_values()) == sft
    with pytest.raises(RecipeError, match=r"^preference: only applies to train.objective: dpo"):
        sft.with_overrides({"preference.beta": 0.5})


def test_text_pairs_tokenize_prompt_and_answers_apart_with_eos(tmp_path, tokenizer):
    prepared = pairs_of(dpo_recipe(write(tmp_path / "p.jsonl", PAIRS)), tokenizer)
    row = prepared.train[0]
    assert set(prepared.train.column_names) == {"prompt_ids", "chosen_ids", "rejected_ids"}
    assert row["prompt_ids"] == tokenizer(PAIRS[0]["prompt"])["input_ids"]
    for side in ("chosen", "rejected"):
        text = PAIRS[0][side] + tokenizer.eos_token
        assert row[f"{side}_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
        assert row[f"{side}_ids"][-1] == tokenizer.eos_token_id


def test_chat_pairs_render_the_prompt_for_generation_and_the_reply_after_it(tmp_path, tokenizer):
    recipe = dpo_recipe(write(tmp_path / "c.jsonl", CHAT_PAIRS), fmt="preference_chat")
    row = pairs_of(recipe, tokenizer).train[0]
    prompt = tokenizer.apply_chat_template(
        CHAT_PAIRS[0]["prompt"], tokenize=False, add_generation_prompt=True
    )
    whole = tokenizer.apply_chat_template(
        [*CHAT_PAIRS[0]["prompt"], {"role": "assistant", "content": "black"}], tokenize=False
    )
    assert tokenizer.decode(row["prompt_ids"]) == prompt
    assert tokenizer.decode(row["prompt_ids"] + row["rejected_ids"]) == whole
    assert tokenizer.decode(row["chosen_ids"]).startswith("white")


def test_the_length_policy_keeps_the_prompts_end_and_cuts_or_drops_long_answers(tmp_path, tokenizer):
    long = [
        {
            "prompt": "one two three four five six seven eight nine ten ",
            "chosen": "green " * 20,
            "rejected": "red",
        }
    ]
    path = write(tmp_path / "long.jsonl", long + PAIRS)
    full_prompt = tokenizer(long[0]["prompt"])["input_ids"]
    cut = pairs_of(dpo_recipe(path, **{"data.max_seq_len": 12, "preference.max_prompt_len": 4}), tokenizer)
    row = cut.train[0]
    assert row["prompt_ids"] == full_prompt[-4:]  # the end of the prompt, next to the answer
    assert len(row["prompt_ids"]) + len(row["chosen_ids"]) == 12
    assert cut.train_reports[0].truncated == 1
    dropped = pairs_of(dpo_recipe(path, **{"data.max_seq_len": 12, "data.overlong": "drop"}), tokenizer)
    assert len(dropped.train) == 2 and dropped.train_reports[0].dropped == 1
    # a long prompt cut to max_prompt_len is the prompt policy, not an overlong pair: kept, nothing dropped
    short = [dict(long[0], chosen="green")]
    kept = pairs_of(
        dpo_recipe(
            write(tmp_path / "short.jsonl", short + PAIRS),
            **{"data.max_seq_len": 12, "data.overlong": "drop", "preference.max_prompt_len": 4},
        ),
        tokenizer,
    )
    assert len(kept.train) == 3 and kept.train_reports[0].dropped == 0
    assert kept.train[0]["prompt_ids"] == full_prompt[-4:]


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"prompt": "Q? ", "chosen": "yes"}, "missing field 'rejected'"),
        ({"prompt": "Q? ", "chosen": "  ", "rejected": "no"}, "field 'chosen' is empty"),
        ({"prompt": "Q? ", "chosen": "yes", "rejected": "yes"}, "chosen and rejected are the same answer"),
        ({"prompt": "Q? ", "chosen": ["yes"], "rejected": "no"}, "field 'chosen' must be text"),
    ],
)
def test_a_bad_pair_is_one_line_naming_the_file_and_row(tmp_path, tokenizer, row, problem):
    path = write(tmp_path / "bad.jsonl", [*PAIRS, row])
    with pytest.raises(DataError, match=re.escape(f"{path}: row 3: {problem}")):
        pairs_of(dpo_recipe(path), tokenizer)


def test_the_demo_pairs_ask_the_sft_demos_questions_framed_as_its_prompts(tokenizer):
    pairs = pairs_of(Recipe.from_yaml("recipes/demo-dpo.yaml"), tokenizer)
    sft_recipe = Recipe.from_yaml("recipes/demo.yaml", overrides={"data.packing": False})
    sft = prepare.prepare_datasets(sft_recipe.data, tokenizer, seed=0)
    assert len(pairs.train) == len(sft.train) and len(pairs.val) == len(sft.val)
    for i in range(len(sft.train)):  # the SFT example is the prompt and the chosen answer, token for token
        pair, example = pairs.train[i], sft.train[i]
        assert example["input_ids"] == pair["prompt_ids"] + pair["chosen_ids"]
        assert (
            pair["rejected_ids"] != pair["chosen_ids"] and pair["rejected_ids"][-1] == tokenizer.eos_token_id
        )
    rows = [json.loads(line) for line in demo.DEMO_DATASETS["demo-preferences"][1].read_text().splitlines()]
    assert pairs.val[0]["prompt_ids"] == tokenizer(alpaca_prompt(rows[0]["instruction"]))["input_ids"]


def test_the_data_view_shows_each_pair_and_passes_the_preflight(tokenizer):
    from qlora_kit.data.report import inspect_data

    view = inspect_data(Recipe.from_yaml("recipes/demo-dpo.yaml"), tokenizer, count=2)
    rows = [json.loads(line) for line in demo.DEMO_DATASETS["demo-preferences"][0].read_text().splitlines()]
    assert len(view.examples) == 2  # count=2: the loop below runs over something
    for runs, row in zip(view.examples, rows[:2], strict=True):
        trained = [text for text, is_trained in runs if is_trained]
        assert trained == [row["chosen"] + tokenizer.eos_token, row["rejected"] + tokenizer.eos_token]
        assert row["instruction"] in runs[0][0] and not runs[0][1]
    assert all(check.passed for check in view.checks), view.checks
