"""Where rows come from: weighted mixtures of sources in different formats, fixed row counts,
deduplication, per-source reports, and a folder of parquet shards."""

import json

import datasets
import pytest

from qlora_kit import Recipe, RecipeError
from qlora_kit.data import prepare


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def alpaca_rows(word: str, count: int) -> list[dict]:
    return [{"instruction": f"Say {word} {i}.", "input": "", "output": f"{word} {i}"} for i in range(count)]


def completion_rows(word: str, count: int) -> list[dict]:
    return [{"prompt": f"Say {word} {i}:", "completion": f" {word} {i}"} for i in range(count)]


def counts(prepared, tokenizer, words) -> dict[str, int]:
    texts = [tokenizer.decode(ids) for ids in prepared.train["input_ids"]]
    return {word: sum(f"Say {word} " in text for text in texts) for word in words}


def test_weights_split_the_weighted_rows_and_rows_take_exactly_that_many(tokenizer, tmp_path):
    data = Recipe.from_dict(
        {
            "data": {
                "packing": False,
                "sources": [
                    {"path": jsonl(tmp_path / "a.jsonl", alpaca_rows("alpha", 120)), "weight": 3},
                    {
                        "path": jsonl(tmp_path / "b.jsonl", completion_rows("beta", 90)),
                        "format": "completion",
                        "weight": 1,
                    },
                    {"path": jsonl(tmp_path / "c.jsonl", alpaca_rows("gamma", 10)), "rows": 25},
                ],
            }
        }
    ).data
    prepared = prepare.prepare_datasets(data, tokenizer, seed=0)
    # 210 weighted rows shared 3:1; the fixed source repeats its 10 rows to give 25
    assert counts(prepared, tokenizer, ["alpha", "beta", "gamma"]) == {"alpha": 158, "beta": 52, "gamma": 25}
    assert [r.taken for r in prepared.train_reports] == [158, 52, 25]
    assert all(r.trained_tokens > 0 for r in prepared.train_reports)
    assert "158 rows in the mixture" in prepared.train_reports[0].summary()
    # seeded: the same mixture again, another seed another sample
    again = prepare.prepare_datasets(data, tokenizer, seed=0)
    assert again.train["input_ids"] == prepared.train["input_ids"]
    other = prepare.prepare_datasets(data, tokenizer, seed=1)
    assert sorted(map(tuple, other.train["input_ids"])) != sorted(map(tuple, prepared.train["input_ids"]))


def test_dedup_leaves_out_repeated_examples_across_sources(tokenizer, tmp_path):
    rows = alpaca_rows("alpha", 10)
    sources = [
        {"path": jsonl(tmp_path / "a.jsonl", rows)},
        {"path": jsonl(tmp_path / "b.jsonl", rows[:4] * 2)},
    ]
    mixed = {"packing": False, "sources": sources}
    assert len(prepare.prepare_datasets(Recipe.from_dict({"data": mixed}).data, tokenizer, 0).train) == 18
    deduped = Recipe.from_dict({"data": {**mixed, "dedup": True}}).data
    assert len(prepare.prepare_datasets(deduped, tokenizer, 0).train) == 10


@pytest.mark.slow
def test_a_mixture_trains_end_to_end_with_the_gpu_path(tmp_path):
    from tests.conftest import quick_recipe

    sources = [
        {"path": jsonl(tmp_path / "a.jsonl", alpaca_rows("alpha", 24)), "weight": 1},
        {
            "path": jsonl(tmp_path / "b.jsonl", completion_rows("beta", 24)),
            "format": "completion",
            "weight": 1,
        },
    ]
    recipe = quick_recipe(
        tmp_path / "out",
        **{
            "train.max_steps": 2,
            "train.logging_steps": 1,
            "train.mixed_precision": "bf16",
            "data.val_fraction": 0.1,
        },
    )
    values = recipe.resolved_values()
    values["data"].pop("path")
    values["data"]["sources"] = sources
    from qlora_kit import train

    result = train(Recipe.from_dict(values))
    assert len(result.train_losses) == 2 and (result.output_dir / "adapter_model.safetensors").exists()


def test_a_folder_of_parquet_shards_loads_as_one_dataset(tokenizer, tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        datasets.Dataset.from_list(alpaca_rows(f"s{i}", 5)).to_parquet(shards / f"part-{i}.parquet")
    data = Recipe.from_dict({"data": {"path": str(shards), "packing": False}}).data
    assert len(prepare.prepare_datasets(data, tokenizer, seed=0).train) == 15


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"path": "a.jsonl", "sources": [{"path": "b.jsonl"}]}, r"^data\.sources: give either data\.path"),
        (
            {"sources": [{"path": "b.jsonl", "weight": 1, "rows": 2}]},
            r"^data\.sources\[0\]\.weight: give a weight",
        ),
        (
            {"sources": [{"path": "b.jsonl", "fields": {"answer": "x"}}]},
            r"^data\.sources\[0\]\.fields: 'answer'",
        ),
        ({"sources": [{"path": "b.jsonl", "weight": 0}]}, r"^data\.sources\.0\.weight: must be > 0"),
        ({"roles": {"bot": "assistant"}}, r"^data\.roles: only applies to format sharegpt"),
        (
            {"format": "text", "system_prompt": "Be brief."},
            r"^data\.system_prompt: format text has no prompt",
        ),
    ],
)
def test_impossible_source_settings_are_one_line_naming_the_field(values, message):
    with pytest.raises(RecipeError, match=message):
        Recipe.from_dict({"data": values})


def test_the_validation_file_reads_with_datas_own_field_names_for_every_objective(tokenizer, tmp_path):
    """data.val_path is data's file: its columns are named by data.fields, not by the first source's, alike
    for SFT's rows and GRPO's prompts (sources.load_val_rows)."""
    from qlora_kit.data.prompts import prepare_prompts

    renamed = [
        {"question": r["instruction"], "input": "", "answer": r["output"]} for r in alpaca_rows("a", 20)
    ]
    data = Recipe.from_dict(
        {
            "data": {
                "packing": False,
                "sources": [
                    {
                        "path": jsonl(tmp_path / "a.jsonl", renamed),
                        "fields": {"instruction": "question", "output": "answer"},
                    }
                ],
                "val_path": jsonl(tmp_path / "val.jsonl", alpaca_rows("v", 6)),
            }
        }
    ).data
    assert len(prepare.prepare_datasets(data, tokenizer, seed=0).val) == 6
    assert len(prepare_prompts(data, tokenizer, seed=0, completion_tokens=16).val) == 6


@pytest.mark.parametrize("objective", ["sft", "kto"])
def test_a_sources_report_says_what_the_mixture_trains_from_it(objective, tokenizer, tmp_path):
    """A capped source whose 5 drawn rows all repeat the first source's: its report says the mixture
    trains none of them (no token, no label) beside what the source held (red when the report gave
    only the source's own figures: "5 rows in the mixture, 5 left out as repeats; 652 trained tokens" and
    "(163 desirable, 163 undesirable answers)")."""
    from qlora_kit.data.demo import demo_data_files
    from qlora_kit.training.objective_trainer import builder

    builtin, fmt = ("demo-facts", "alpaca") if objective == "sft" else ("demo-feedback", "feedback")
    rows = [json.loads(line) for line in demo_data_files(builtin)[0].read_text().splitlines()][:40]
    first, again = jsonl(tmp_path / "first.jsonl", rows), jsonl(tmp_path / "again.jsonl", rows)
    recipe = Recipe.from_dict(
        {
            "data": {
                "format": fmt,
                "packing": False,
                "dedup": True,
                "val_fraction": 0.0,
                "sources": [{"path": first}, {"path": again, "rows": 5}],
            },
            "train": {"objective": objective},
        }
    )
    reports = builder(recipe).prepare(recipe, tokenizer).train_reports
    whole, repeated = reports
    assert (repeated.taken, repeated.repeats) == (5, 5) and repeated.trained_tokens > 0
    assert (repeated.trains.rows, repeated.trains.trained_tokens) == (0, 0)
    assert (whole.trains.rows, whole.trains.trained_tokens) == (40, whole.trained_tokens)
    said = repeated.summary()
    assert "5 rows in the mixture, 5 left out as repeats: the mixture trains 0 of its rows, 0 trained" in said
    if objective == "kto":
        desirable = sum(row["label"] for row in rows)
        assert f"({desirable} desirable, {40 - desirable} undesirable answers)" in whole.summary()
        assert said.endswith("0 trained tokens (0 desirable, 0 undesirable answers)"), said
