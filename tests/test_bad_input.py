"""Bad input, generated: every wrong recipe or command line gives one clear line and exit code 2."""

import sys

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlora_kit import Recipe, cli

SECTIONS = {name: type(getattr(Recipe(), name)) for name in Recipe.model_fields}
NUMERIC_LIMITS = [
    ("lora", "rank", 0),
    ("lora", "alpha", -1.0),
    ("lora", "dropout", 1.0),
    ("optimizer", "lr", 0.0),
    ("optimizer", "warmup_ratio", 1.5),
    ("optimizer", "max_grad_norm", -0.1),
    ("data", "max_seq_len", 0),
    ("data", "val_fraction", 1.0),
    ("train", "epochs", 0),
    ("train", "micro_batch_size", -4),
    ("train", "grad_accum", 0),
    ("train", "logging_steps", 0),
    ("memory", "every_n", 0),
    ("memory", "loss_chunk_tokens", 0),
]
NONSENSE = [
    {"quant": {"bits": 16, "double_quant": True}},
    {"quant": {"bits": 16, "quant_type": "fp4"}},
    {"train": {"fsdp": True}},
    {"data": {"path": "rows.jsonl"}, "train": {"eval_steps": 10}},
    {"data": {"packing": True, "group_by_length": True}},
    {"data": {"format": "chat", "fields": {"output": "answer"}}},
    {"memory": {"checkpointing": "auto"}},
    {"lora": {"dora": True, "init": "olora"}},
]
# Never a valid value of any recipe field: containers where scalars belong (and ints inside, where
# strings belong), and words no number or boolean parser accepts.
WRONG_VALUES = st.one_of(
    st.lists(st.integers(), min_size=1, max_size=3),
    st.dictionaries(st.text(min_size=1, max_size=4), st.integers(), min_size=1, max_size=2),
    st.sampled_from(["lots", "abc", "🙂", "twelve"]),
)


def field_names():
    return st.sampled_from([(s, f) for s, model in SECTIONS.items() for f in model.model_fields])


@st.composite
def bad_recipes(draw):
    kind = draw(
        st.sampled_from(
            ["unknown key", "unknown section", "wrong type", "out of range", "missing file", "nonsense"]
        )
    )
    if kind == "unknown key":
        section = draw(st.sampled_from(sorted(SECTIONS)))
        key = draw(
            st.from_regex(r"[a-z]{3,10}", fullmatch=True).filter(
                lambda k: k not in SECTIONS[section].model_fields
            )
        )
        return {section: {key: 1}}, f"{section}.{key}"
    if kind == "unknown section":
        section = draw(st.from_regex(r"[a-z]{3,10}", fullmatch=True).filter(lambda k: k not in SECTIONS))
        return {section: {"x": 1}}, section
    if kind == "wrong type":
        section, name = draw(field_names())
        annotation = str(SECTIONS[section].model_fields[name].annotation)
        value = draw(WRONG_VALUES)
        if "str" in annotation and isinstance(value, str):
            value = [1, 2]  # a word is a valid value of a str field
        if name == "fields":
            value = draw(st.sampled_from([3.5, ["answer"], {"output": 7}]))
        return {section: {name: value}}, f"{section}.{name}"
    if kind == "out of range":
        section, name, value = draw(st.sampled_from(NUMERIC_LIMITS))
        return {section: {name: value}}, f"{section}.{name}"
    if kind == "missing file":
        name = draw(st.from_regex(r"[a-z]{4,10}", fullmatch=True))
        return {"data": {"path": f"./{name}.jsonl", "val_fraction": 0.1}}, "data.path"
    return draw(st.sampled_from(NONSENSE)), ""


def run_cli(argv, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["qlora-kit", *argv])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    captured = capsys.readouterr()
    return exit_info.value.code, captured.err


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(case=bad_recipes())
def test_every_bad_recipe_is_one_line_and_exit_2(case, tmp_path, monkeypatch, capsys):
    values, field = case
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(values))
    code, err = run_cli(["validate", str(path)], monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert field in lines[0]
    assert "Traceback" not in err


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    command=st.sampled_from(["train", "validate", "data", "plan", "eval", "generate", "chat", "merge"]),
    flag=st.from_regex(r"--[a-z]{4,12}", fullmatch=True),
)
def test_unknown_flags_are_one_line_and_exit_2(command, flag, monkeypatch, capsys):
    known = {
        "--set",
        "--output-dir",
        "--overwrite",
        "--resume",
        "--resume-from",
        "--examples",
        "--budget-gb",
        "--batch",
        "--seq",
        "--device",
        "--adapter",
        "--no-adapter",
        "--max-examples",
        "--output",
        "--prompt",
        "--file",
        "--raw",
        "--max-new-tokens",
        "--temperature",
        "--top-p",
        "--out",
        "--base",
        "--force",
        "--max-kl",
        "--min-top1",
        "--help",
    }
    if flag in known:
        return
    code, err = run_cli([command, "recipes/demo.yaml", flag], monkeypatch, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: qlora-kit {command}: No such option: {flag}"), err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train"], "Missing argument 'recipe'"),
        (["plan", "recipes/demo.yaml", "--budget-gb", "lots"], "Invalid value for '--budget-gb'"),
        (["generate", "--adapter", "x", "--max-new-tokens", "many"], "Invalid value for '--max-new-tokens'"),
        (["merge", "--adapter", "x"], "Missing option '--out'"),
        (["generate", "--adapter", "nowhere", "--prompt", "hi"], "--adapter: nowhere holds no adapter"),
        (
            ["merge", "--adapter", "outputs", "--out", "m", "--base", "int3"],
            "--base: must be dequantized or original",
        ),
        (["eval"], "eval: give a RECIPE, or --adapter DIR"),
        (["nosuchcommand"], "No such command 'nosuchcommand'"),
    ],
)
def test_bad_command_lines_are_one_line_and_exit_2(argv, message, monkeypatch, capsys):
    code, err = run_cli(argv, monkeypatch, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err
