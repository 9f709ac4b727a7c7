from pathlib import Path

import pytest
import yaml

from qlora_kit import Recipe, RecipeError
from qlora_kit.recipe.recipe import apply_overrides

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_are_the_qlora_setup():
    recipe = Recipe()
    assert (recipe.quant.quant_type, recipe.quant.double_quant, recipe.quant.compute_dtype) == (
        "nf4",
        True,
        "bfloat16",
    )
    assert recipe.optimizer.name == "paged_adamw_8bit"
    assert recipe.optimizer.max_grad_norm == 0.3
    assert recipe.memory.checkpointing == "full"
    assert recipe.lora.target_modules == "all-linear"


def test_every_field_has_a_description():
    for section in Recipe.model_fields:
        model = type(getattr(Recipe(), section))
        for name, field in model.model_fields.items():
            assert field.description, f"{section}.{name} has no docstring"


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    recipe = Recipe.from_yaml(path)
    assert path.read_text().startswith("#"), "each recipe opens with a header comment"
    # YAML holds values, not copies of defaults: every value written must differ from the default.
    written = yaml.safe_load(path.read_text())
    defaults = Recipe().model_dump()
    for section, values in written.items():
        for key, value in values.items():
            assert value != defaults[section][key], f"{path.name}: {section}.{key} repeats the default"
    assert recipe.train.output_dir


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["lora.rank=0"], "lora.rank: must be > 0 (got 0)"),
        (["lora.ranks=8"], "lora.ranks: unknown key"),
        (["nosuch.field=1"], "nosuch: unknown key"),
        (["optimizer.name=sgd"], "optimizer.name: must be one of"),
        (["train.epochs=abc"], "train.epochs: input should be a valid number"),
        (["lora.dropout=1.5"], "lora.dropout: must be >= 0 and < 1, or auto (got 1.5)"),
        # a field of several types: what each takes, once, not pydantic's branch names and a problem count
        (
            ["data.packing=3"],
            "data.packing: input should be a valid boolean, unable to interpret input (got '3'), or 'auto'",
        ),
        (["data.path=rows.jsonl", "train.eval_steps=10"], "train.eval_steps: needs validation data"),
        (
            ["lora.dora=true", "lora.init=pissa", "quant.bits=16"],
            "lora.init: pissa cannot be combined with lora.dora",
        ),
        (["lora.rank"], "--set 'lora.rank': expected section.field=value"),
        (["rank=3"], "--set rank: expected section.field"),
    ],
)
def test_mistakes_name_the_field_and_value(overrides, message):
    with pytest.raises(RecipeError) as info:
        Recipe.from_yaml(ROOT / "recipes" / "demo.yaml", overrides=overrides)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_overrides_are_parsed_as_yaml_scalars():
    values = apply_overrides({}, ["lora.rank=8", "lora.rslora=true", "lora.target_modules=[q_proj, v_proj]"])
    recipe = Recipe.from_dict(values)
    assert recipe.lora.rank == 8 and recipe.lora.rslora is True
    assert recipe.lora.target_modules == ["q_proj", "v_proj"]


def test_set_reaches_a_field_at_any_depth():
    recipe = Recipe.from_yaml(
        ROOT / "recipes" / "demo.yaml",
        overrides=["data.preflight.min_end_token_share=0", "data.preflight.max_untrained_share=0.25"],
    )
    assert recipe.data.preflight.min_end_token_share == 0
    assert recipe.data.preflight.max_untrained_share == 0.25
    assert recipe.data.source_list() == Recipe.from_yaml(ROOT / "recipes" / "demo.yaml").data.source_list()
    with pytest.raises(RecipeError, match=r"^data\.preflight\.nosuch: unknown key"):
        Recipe.from_yaml(ROOT / "recipes" / "demo.yaml", overrides=["data.preflight.nosuch=1"])


@pytest.mark.parametrize(
    "typed", ["no", "yes", "on", "off", "null", "NULL", "~", "1e3", "1.10", "0123", "true"]
)
def test_a_text_field_gets_the_text_typed_on_the_command_line(typed):
    """YAML 1.1 reads no/yes/on/off as booleans, null as None and 1.10 as a number; a field that takes
    text (and not what YAML reads) gets the text as typed."""
    values = apply_overrides({}, [f"model.revision={typed}", f"train.project={typed}"])
    assert values["train"]["project"] == typed
    # model.revision takes None too: YAML's null spellings unset it, as in a recipe file
    assert values["model"]["revision"] == (None if typed in ("null", "NULL", "~") else typed)
    recipe = Recipe.from_yaml(ROOT / "recipes" / "demo.yaml", overrides=[f"train.project={typed}"])
    assert recipe.train.project == typed


def test_a_literal_field_gets_its_choice_and_other_fields_keep_yaml_types():
    recipe = Recipe.from_yaml(
        ROOT / "recipes" / "demo.yaml",
        overrides=["train.mixed_precision=no", "data.packing=true", "lora.rank=8", "lora.dropout=0"],
    )
    assert recipe.train.mixed_precision == "no"
    assert recipe.data.packing is True and recipe.lora.rank == 8 and recipe.lora.dropout == 0.0
    assert (
        Recipe.from_yaml(ROOT / "recipes" / "demo.yaml", overrides=["data.packing=auto"]).data.packing
        == "auto"
    )


def test_relative_paths_resolve_against_the_recipe_folder(tmp_path):
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "r.yaml").write_text("data:\n  path: ../data/train.jsonl\nmodel:\n  path: org/model\n")
    recipe = Recipe.from_yaml(folder / "r.yaml")
    assert recipe.data.path == str(tmp_path / "data" / "train.jsonl")
    assert recipe.model.path == "org/model"  # a hub id stays as written


def test_bad_yaml_and_non_mapping_are_one_line_errors(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("lora: [unclosed\n")
    with pytest.raises(RecipeError, match=r"broken\.yaml: not valid YAML"):
        Recipe.from_yaml(broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(RecipeError, match="a recipe must be a mapping"):
        Recipe.from_yaml(listing)


def test_resolved_recipe_round_trips_through_yaml(tmp_path):
    recipe = Recipe.from_yaml(ROOT / "recipes" / "demo.yaml", overrides=["lora.rank=4"])
    again = Recipe.from_dict(yaml.safe_load(recipe.to_yaml()))
    assert again == recipe


def test_fsdp_needs_quant_storage_equal_to_compute_dtype_and_an_optimizer_that_steps_shards():
    fsdp = {"train": {"fsdp": True}, "optimizer": {"name": "adamw_torch"}}
    with pytest.raises(
        RecipeError, match=r"^quant.quant_storage: must equal quant.compute_dtype \(bfloat16\)"
    ):
        Recipe.from_dict(fsdp)
    for name in ("paged_adamw_8bit", "adamw_8bit", "paged_adamw_32bit"):
        with pytest.raises(RecipeError, match=rf"^optimizer.name: {name} cannot step FSDP2's sharded"):
            Recipe.from_dict(fsdp | {"optimizer": {"name": name}, "quant": {"quant_storage": "bfloat16"}})
    Recipe.from_dict(fsdp | {"quant": {"quant_storage": "bfloat16"}})  # the chunked head works under FSDP2
    recipe = Recipe.from_yaml(ROOT / "recipes" / "llama3-8b-alpaca-fsdp-2x24gb.yaml")
    assert recipe.quant.quant_storage == recipe.quant.compute_dtype and recipe.train.fsdp


def test_a_run_launched_with_fsdp_refuses_a_recipe_without_it(monkeypatch, tmp_path):
    from qlora_kit import train

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(RecipeError, match=r"^train\.fsdp: this run is launched with an FSDP config"):
        train(Recipe.from_dict({"train": {"output_dir": str(tmp_path / "out"), "max_steps": 1}}))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"quant": {"bits": 16}},
        {"quant": {"bits": 16}, "lora": {"init": "pissa"}},
        {"data": {"format": "chat", "system_prompt_mode": "merge_into_first_user"}},
        {"memory": {"checkpointing": "auto", "budget_gb": 20, "over_budget": True}},
    ],
)
def test_the_saved_recipe_loads_back_as_the_same_recipe(values):
    """recipe.yaml beside an adapter is what eval, generate, merge and --resume load: it must round-trip
    (a quant.bits 16 recipe used to write 4-bit-only fields that its own validation then refused)."""
    recipe = Recipe.from_dict(values)
    assert Recipe.from_dict(yaml.safe_load(recipe.to_yaml())) == recipe
    assert recipe.with_overrides({"train.max_steps": 3}).train.max_steps == 3


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({"keep_best": "eval_loss"}, r"^train\.keep_best: needs train\.eval_steps"),
        ({"early_stopping_patience": 3}, r"^train\.early_stopping_patience: needs train\.eval_steps"),
        (
            {"keep_best": "eval_loss", "eval_steps": 4, "save_steps": 6},
            r"^train\.save_steps: must be a multiple of train\.eval_steps \(4\)",
        ),
        ({"keep_best": "eval_loss", "eval_steps": 4}, r"^train\.save_steps: must be a multiple"),
    ],
)
def test_keep_best_and_early_stopping_need_evaluations_with_checkpoints(train, message):
    with pytest.raises(RecipeError, match=message):
        Recipe.from_dict({"train": train})
    ok = Recipe.from_dict(
        {"train": {"keep_best": "eval_loss", "eval_steps": 4, "save_steps": 8, "early_stopping_patience": 2}}
    )
    assert ok.train.keep_best == "eval_loss"
