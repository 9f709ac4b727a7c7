"""Recipes round-trip by construction: a property test over the whole recipe schema.

A run writes its resolved recipe (every field, defaults included) to recipe.yaml, and everything after
training (--resume, eval, generate, merge, show) loads it back. So for any valid recipe, across every
section: the dump loads back as the same recipe, and the command line's --set and --output-dir give the
same result (or the same one-line error) whether they are applied to the user's file or to the run's
recipe.yaml. Exclusivity decided by which fields a file *set* broke both (issue 35: a mixture's
data.path; quant.bits 16's 4-bit-only fields before it).

The generator is derived from the schema: every field of every section gets values of its type and
bounds (the few free-text and path fields have their own), so a field added later is covered, and a
field of a kind the generator cannot make fails here instead of going untested.
"""

from __future__ import annotations

import json
import re
import types
import typing
from pathlib import Path

import annotated_types
import pytest
import yaml
from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import strategies as st
from pydantic import BaseModel, TypeAdapter, ValidationError

from qlora_kit.cli.app import load_recipe
from qlora_kit.errors import RecipeError
from qlora_kit.model.builtin import TINY_ARCHITECTURES
from qlora_kit.recipe.data import SourceSection
from qlora_kit.recipe.recipe import Recipe, apply_overrides
from qlora_kit.registries import checkpointing as checkpointing_table
from qlora_kit.registries.attention import KERNELS
from qlora_kit.registries.formats import FORMATS

PAIR_FORMATS = sorted(name for name, spec in FORMATS.items() if spec.pairs)
ROW_FORMATS = sorted(
    name for name, spec in FORMATS.items() if spec.rows == "sequences"
)  # not kto's labelled rows
FIELD_NAMES = sorted({field for spec in FORMATS.values() for field in spec.fields})
WORDS = st.from_regex(r"[a-z][a-z_]{0,8}", fullmatch=True)
DATA_PATHS = st.sampled_from(["builtin:demo-facts", "/data/rows.jsonl", "/data/shards", "org/facts"])

# Fields whose values are not made from their type alone: paths, names, free text and containers.
SPECIAL = {
    "model.path": st.sampled_from(
        [f"builtin:{name}" for name in TINY_ARCHITECTURES] + ["org/model", "/models/base"]
    ),
    "model.revision": st.none() | st.sampled_from(["main", "v1.0", "0123abcd"]),
    "model.adapter": st.none() | st.just("/runs/sft"),
    "model.attn_implementation": st.sampled_from([*KERNELS, "kernels-community/flash-attn", "org/kernel"]),
    "data.path": st.none() | DATA_PATHS,
    "data.config_name": st.none() | st.just("default"),
    "data.val_path": st.none() | st.just("/data/val.jsonl"),
    "data.packing": st.sampled_from([True, False, "auto"]),
    "memory.chunked_loss": st.sampled_from([True, False, "auto"]),
    "memory.checkpointing": st.sampled_from(checkpointing_table.names()),
    "train.probe_worst_batch": st.sampled_from([True, False, "auto"]),
    "memory.mlp_tiles": st.sampled_from([1, 2, 4, "auto"]),
    "memory.experts_on_host": st.sampled_from([False, True, "auto"]),
    "train.compile": st.sampled_from([False, True, "auto"]),
    "lora.dropout": st.sampled_from(["auto", 0.0]) | st.floats(0, 0.99),
    "data.fields": st.dictionaries(st.sampled_from(FIELD_NAMES), WORDS, max_size=2),
    "data.roles": st.dictionaries(
        st.sampled_from(["bot", "human2", "narrator"]), st.sampled_from(["assistant", "user"]), max_size=2
    ),
    # any text: a system prompt the run cannot read back from its own recipe.yaml is this bug's kind
    "data.system_prompt": st.none() | st.text(max_size=24),
    "train.output_dir": st.sampled_from(["/runs/a", "/runs/ünï côdé", "/runs/a: b"]),
    "train.keep_best": st.none() | st.sampled_from(["eval_loss", "eval_accuracy"]),
    "train.run_name": st.none() | st.text(min_size=1, max_size=12),
    "train.project": st.text(min_size=1, max_size=12),
    "train.report_to": st.lists(
        st.sampled_from(["tensorboard", "wandb", "mlflow", "trackio"]), unique=True, max_size=2
    ),
    "memory.layer_policies": st.none()
    | st.lists(st.sampled_from(checkpointing_table.layer_policies()), min_size=1, max_size=4),
    "lora.target_modules": st.just("all-linear")
    | st.lists(
        st.sampled_from(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"]),
        min_size=1,
        max_size=3,
        unique=True,
    ),
    "grpo.rewards": st.lists(
        st.sampled_from(
            [
                {"name": "exact_match"},
                {"name": "number_match", "weight": 0.5},
                {"name": "regex", "pattern": "^[0-9]+$"},
                {"name": "length", "min_chars": 1, "max_chars": 9},
                {"name": "my_rewards:score", "weight": 2.0},
            ]
        ),
        min_size=1,
        max_size=3,
    ),
    "source.path": DATA_PATHS,
    "source.config_name": st.none() | st.just("default"),
    "source.fields": st.dictionaries(st.sampled_from(FIELD_NAMES), WORDS, max_size=2),
}


def bounds(metadata: list) -> dict:
    limits = {}
    for item in metadata:
        for name in ("gt", "ge", "lt", "le"):
            if isinstance(item, getattr(annotated_types, name.capitalize())):
                limits[name] = getattr(item, name)
    return limits


def number_strategy(kind: type, limits: dict) -> st.SearchStrategy:
    low = limits.get("ge", limits.get("gt", 0))
    if kind is int:
        low += "gt" in limits
        return st.integers(low, low + 64)
    high = limits.get("le", limits.get("lt", low + 8))
    return st.floats(low, high, exclude_min="gt" in limits, exclude_max="lt" in limits, allow_nan=False)


def value_strategy(key: str, annotation, metadata: list, formats: list[str]) -> st.SearchStrategy:
    if key in SPECIAL:
        return SPECIAL[key]
    if key.endswith(".format"):  # the objective decides which formats can train
        return st.sampled_from(formats)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        (inner,) = [arg for arg in args if arg is not type(None)]
        return st.none() | value_strategy(key, inner, metadata, formats)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if annotation is bool:
        return st.booleans()
    if annotation in (int, float):
        return number_strategy(annotation, bounds(metadata))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return section_values(annotation, key, formats)
    raise AssertionError(f"{key}: no strategy for {annotation}; add one to SPECIAL")


def section_values(model: type[BaseModel], prefix: str, formats: list[str]) -> st.SearchStrategy:
    """Some of the section's fields (a file sets a few), each a value of its type."""
    optional = {}
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}"
        if key == "data.sources":
            optional[name] = st.lists(
                section_values(SourceSection, "source", formats), min_size=1, max_size=3
            )
        elif key != "train.objective":  # drawn first: it decides the formats
            optional[name] = value_strategy(key, field.annotation, field.metadata, formats)
    required = {name: optional.pop(name) for name, field in model.model_fields.items() if field.is_required()}
    return st.fixed_dictionaries(required, optional=optional)


def drop(values: dict, message: str) -> bool:
    """Take out the field a validation error names (``data.sources[0].weight: ...``); False when absent."""
    named = message.split(":", 1)[0].split(" ", 1)[0]
    parts = [int(p) if p.isdigit() else p for p in re.split(r"[.\[\]]+", named) if p]
    holder = values
    for part in parts[:-1]:
        try:
            holder = holder[part]
        except (KeyError, IndexError, TypeError):
            return False
    if isinstance(holder, dict) and parts and parts[-1] in holder:
        del holder[parts[-1]]
        return True
    return False


@st.composite
def user_recipes(draw) -> tuple[dict, Recipe]:
    """A recipe file's values across every section, and the recipe they load as. Values that break a
    cross-field rule are taken out again, one named field at a time, so the valid recipes stay varied."""
    objective = draw(st.sampled_from(["sft", "dpo", "grpo"]))
    formats = PAIR_FORMATS if objective == "dpo" else ROW_FORMATS
    if objective == "grpo":  # a prompt and a reference: not text
        formats = [f for f in ROW_FORMATS if f != "text"]
    values = {}
    for name, field in Recipe.model_fields.items():
        section = draw(section_values(field.annotation, name, formats))
        if section:
            values[name] = section
    values.setdefault("train", {})["objective"] = objective
    data = values.setdefault("data", {})
    if objective == "dpo":
        data.setdefault("format", formats[0])
    if objective == "grpo":  # a reward at least, and room for the prompt beside the completion
        grpo = values.setdefault("grpo", {})
        grpo.setdefault("rewards", [{"name": "exact_match"}])
        data["max_seq_len"] = grpo.get("max_completion_length", 256) + data.get("max_seq_len", 64)
    # the shapes this issue is about, often enough: every builtin model, mixtures, 16-bit bases, the auto
    # checkpointing policy
    if draw(st.booleans()):
        values.setdefault("model", {})["path"] = draw(SPECIAL["model.path"])
    if draw(st.booleans()):
        data.pop("path", None)
        data["sources"] = draw(
            st.lists(section_values(SourceSection, "source", formats), min_size=1, max_size=3)
        )
    if draw(st.booleans()):
        values.setdefault("quant", {})["bits"] = 16
    if draw(st.booleans()):
        values["memory"] = values.get("memory", {}) | {"checkpointing": "auto", "budget_gb": 24}
    for _ in range(12):
        try:
            return values, Recipe.from_dict(values)
        except RecipeError as exc:
            if not drop(values, str(exc)):
                break
    reject()


def overrides() -> st.SearchStrategy:
    """--set lines over any field (train.objective included: no default follows another field, since
    data.packing: auto resolves at run time), and the switches between exclusive fields in particular."""
    anywhere = []
    for key, inner in leaf_fields(Recipe):
        if key.startswith("data.sources"):
            continue
        strategy = value_strategy(key, inner.annotation, inner.metadata, [*ROW_FORMATS, *PAIR_FORMATS])
        anywhere.append(strategy.map(lambda value, key=key: f"{key}={json.dumps(value)}"))
    switches = st.sampled_from(
        [
            'data.sources=[{"path": "builtin:demo-facts", "weight": 2}]',
            "data.sources=[]",
            "data.path=/data/rows.jsonl",
            "data.path=null",
            "quant.bits=16",
            "quant.bits=4",
            "quant.quant_type=fp4",
            "preference.beta=0.5",
            "preference.loss_type=sigmoid",
        ]
    )
    return st.lists(switches | st.one_of(anywhere), max_size=3)


def leaf_fields(model: type[BaseModel], prefix: str = ""):
    """(dotted key, field) for every field that is not itself a section, at any depth (--set reaches all)."""
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from leaf_fields(field.annotation, f"{key}.")
        else:
            yield key, field


def takes_text(annotation) -> list[str] | None:
    """The texts a field takes: its literal choices, [] for free text, None for a field that takes none."""
    if typing.get_origin(annotation) is typing.Literal:
        return [a for a in typing.get_args(annotation) if isinstance(a, str)] or None
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found = [takes_text(arg) for arg in typing.get_args(annotation)]
        found = [f for f in found if f is not None]
        return None if not found else [] if [] in found else [text for f in found for text in f]
    return [] if annotation is str else None


TEXT_FIELDS = [(key, field) for key, field in leaf_fields(Recipe) if takes_text(field.annotation) is not None]
# What YAML 1.1 reads as something other than text: booleans, None, numbers
NOT_TEXT_TO_YAML = [
    "no",
    "yes",
    "on",
    "off",
    "Off",
    "y",
    "null",
    "Null",
    "~",
    "1e3",
    "1.10",
    "0123",
    "12",
    "true",
]


@st.composite
def typed_text_sets(draw) -> tuple[str, str]:
    key, field = draw(st.sampled_from(TEXT_FIELDS))
    choices = takes_text(field.annotation)
    return key, draw(st.sampled_from(choices or NOT_TEXT_TO_YAML))


def user_yaml(values: dict) -> str:
    """The recipe as a user writes it, unicode as it is typed. PyYAML writes NEL, LS and PS raw under
    allow_unicode and reads them back as line breaks (YAML's own line-break characters), so a text that
    holds one is written escaped, as a user would have to write it."""
    breaks = any(c in json.dumps(values, ensure_ascii=False) for c in "\x85\u2028\u2029")
    return yaml.safe_dump(values, allow_unicode=not breaks)


def loaded(path: Path, sets: list[str], output_dir: str | Path | None) -> Recipe | str:
    """What the command line makes of a recipe file: the recipe, or its one-line error."""
    try:
        return load_recipe(path, sets, None if output_dir is None else Path(output_dir))
    except RecipeError as exc:
        return f"error: {exc}"


# No shrinking: a failing case is printed as found (shrinking a whole recipe takes minutes).
FAST = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.filter_too_much],
    phases=[Phase.explicit, Phase.generate],
)


@FAST
@given(case=user_recipes())
def test_a_saved_recipe_loads_back_as_the_same_recipe(case, tmp_path_factory):
    _, recipe = case
    saved = tmp_path_factory.mktemp("run") / "recipe.yaml"
    saved.write_text(recipe.to_yaml(), encoding="utf-8")
    again = Recipe.from_yaml(saved)
    assert again == recipe
    assert again.to_yaml() == recipe.to_yaml()


@FAST
@given(case=user_recipes(), sets=overrides(), output_dir=st.none() | st.just("/runs/elsewhere"))
def test_set_and_output_dir_do_the_same_to_the_users_file_and_the_runs_recipe(
    case, sets, output_dir, tmp_path_factory
):
    values, recipe = case
    folder = tmp_path_factory.mktemp("recipes")
    users, runs = folder / "mine.yaml", folder / "recipe.yaml"
    users.write_text(user_yaml(values), encoding="utf-8")
    runs.write_text(recipe.to_yaml(), encoding="utf-8")
    assert loaded(runs, sets, output_dir) == loaded(users, sets, output_dir)


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml")), ids=lambda p: p.stem
)
def test_every_shipped_recipe_loads_back_as_itself(path, tmp_path):
    recipe = Recipe.from_yaml(path)
    saved = tmp_path / "recipe.yaml"
    saved.write_text(recipe.to_yaml(), encoding="utf-8")
    assert Recipe.from_yaml(saved) == recipe
    for sets in (["train.max_steps=3", "lora.rank=8"], ["quant.bits=16"], ["data.sources=[{path: x.jsonl}]"]):
        assert loaded(saved, sets, tmp_path / "out") == loaded(path, sets, tmp_path / "out")


def test_a_mixture_run_writes_no_data_path_and_takes_its_overrides(tmp_path):
    mix = tmp_path / "mix.yaml"
    mix.write_text("data:\n  sources:\n    - path: builtin:demo-facts\n")
    recipe = load_recipe(mix, [], tmp_path / "runs" / "a")  # `train mix.yaml --output-dir runs/a`
    assert recipe.data.path is None and recipe.data.source_list()[0].path == "builtin:demo-facts"
    saved = tmp_path / "recipe.yaml"
    saved.write_text(recipe.to_yaml())
    assert yaml.safe_load(saved.read_text())["data"]["path"] is None
    assert load_recipe(saved, ["train.max_steps=2"], None) == recipe.with_overrides({"train.max_steps": 2})


def test_the_text_fields_are_found():
    keys = [key for key, _ in TEXT_FIELDS]
    assert {"train.mixed_precision", "model.revision", "train.project", "data.packing"} <= set(keys)


@FAST
@given(typed=st.lists(typed_text_sets(), min_size=1, max_size=4, unique_by=lambda kv: kv[0]))
def test_set_hands_a_text_field_the_text_typed(typed):
    """--set key=value: a field that takes text gets the text typed, never YAML 1.1's reading of it
    (``no`` as false, ``1.10`` as 1.1), unless the field takes that reading too (None for an optional
    field, true for data.packing)."""
    values = apply_overrides({}, [f"{key}={text}" for key, text in typed])
    for key, text in typed:
        section, *path = key.split(".")
        got = values[section]
        for name in path:
            got = got[name]
        read = yaml.safe_load(text)
        try:  # pydantic's strict mode as the judge of whether the field takes YAML's reading as it is
            TypeAdapter(dict(TEXT_FIELDS)[key].annotation).validate_python(read, strict=True)
            takes_read = True
        except ValidationError:
            takes_read = False
        assert got == (read if takes_read else text), (key, text, got)
