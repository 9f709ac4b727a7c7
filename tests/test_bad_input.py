"""Bad input, generated: every wrong recipe or command line gives one clear line and exit code 2."""

import json
import shutil
from pathlib import Path
from typing import get_args

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qlora_kit import Recipe

from .conftest import run_cli, run_cli_output

ROOT = Path(__file__).resolve().parents[1]

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
# Impossible combinations, each with the field its one line must name first.
NONSENSE = [
    # not double_quant: true, the default: a run's recipe.yaml holds it, and it must load back
    ({"quant": {"bits": 16, "double_quant": False}}, "quant.double_quant"),
    ({"quant": {"bits": 16, "quant_type": "fp4"}}, "quant.quant_type"),
    ({"train": {"fsdp": True}}, "quant.quant_storage"),
    ({"data": {"path": "rows.jsonl"}, "train": {"eval_steps": 10}}, "train.eval_steps"),
    ({"data": {"packing": True, "group_by_length": True}}, "data.group_by_length"),
    ({"data": {"format": "chat", "fields": {"output": "answer"}}}, "data.fields"),
    ({"memory": {"checkpointing": "auto"}}, "memory.budget_gb"),
    ({"lora": {"dora": True, "init": "olora"}}, "lora.init"),
    ({"data": {"path": "builtin:demo-facts", "sources": [{"path": "builtin:demo-facts"}]}}, "data.sources"),
    ({"preference": {"beta": 0.5}}, "preference"),
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
    values, field = draw(st.sampled_from(NONSENSE))
    return values, f"error: {field}: "


@pytest.mark.slow  # 150 or 60 CLI runs: the full suite runs it
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
    assert field and field in lines[0], (field, err)
    assert "Traceback" not in err


@pytest.mark.slow  # 150 or 60 CLI runs: the full suite runs it
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
        (["generate", "--adapter", "nowhere", "--prompt", "hi"], "--adapter: nowhere does not exist"),
        # a prompt may be positional (ollama run, llm): parsed, so the adapter is what is wrong here
        (
            ["generate", "--adapter", "nowhere", "What sound does a cow make?"],
            "--adapter: nowhere does not exist",
        ),
        (["generate", "--adapter", "nowhere"], "generate: give a prompt (TEXT or --prompt TEXT)"),
        (
            ["merge", "--adapter", "outputs", "--out", "m", "--base", "int3"],
            "--base: must be dequantized or original",
        ),
        (["eval"], "eval: give a RECIPE, or --adapter DIR"),
        # settings transformers' generate refuses with a traceback, named before the weights load
        (
            ["generate", "--adapter", "x", "--max-new-tokens", "-1", "hi"],
            "--max-new-tokens: must be >= 1 (got -1)",
        ),
        (["chat", "--adapter", "x", "--max-new-tokens", "0"], "--max-new-tokens: must be >= 1 (got 0)"),
        (["generate", "--adapter", "x", "--temperature", "-0.5", "hi"], "--temperature: must be >= 0"),
        (["generate", "--adapter", "x", "--top-p", "0", "hi"], "--top-p: must be in (0, 1] (got 0.0)"),
        (["nosuchcommand"], "No such command 'nosuchcommand'"),
    ],
)
def test_bad_command_lines_are_one_line_and_exit_2(argv, message, monkeypatch, capsys):
    code, err = run_cli(argv, monkeypatch, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], err


FLOAT_FIELDS = [
    (section, name)
    for section, model in SECTIONS.items()
    for name, info in model.model_fields.items()
    if info.annotation is float or float in get_args(info.annotation)
]


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan"])
@pytest.mark.parametrize(("section", "name"), FLOAT_FIELDS)
def test_non_finite_numbers_are_refused_at_validation(section, name, value, tmp_path, monkeypatch, capsys):
    path = tmp_path / "r.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    code, err = run_cli(["validate", str(path)], monkeypatch, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {section}.{name}: "), err
    assert "finite" in lines[0]


# --- Every path argument of every subcommand, pointed at something wrong -----------------------------
# Each case: (command line with {WRONG} where the bad path goes, the kind of wrong path). Kinds are made
# by make_wrong_path below: missing, an empty folder, a file where a folder goes (and the reverse),
# corrupt JSON / YAML / safetensors contents, and the wrong kind of folder.
RECIPE = "recipes/demo.yaml"
RUN_FOLDER_KINDS = [
    "missing",
    "file",
    "empty folder",
    "corrupt adapter config",
    "truncated adapter",
    "model folder",
]
MODEL_FOLDER_KINDS = [
    "file",
    "empty folder",
    "config not json",
    "config without weights",
    "truncated weights",
    "no tokenizer",
    "adapter folder",
]
PATH_CASES = [
    *[(["train", "{WRONG}"], kind) for kind in ["missing yaml", "folder", "corrupt yaml"]],
    *[(["validate", "{WRONG}"], kind) for kind in ["missing yaml", "folder", "corrupt yaml"]],
    *[(["data", "{WRONG}"], kind) for kind in ["missing yaml", "folder", "corrupt yaml"]],
    *[(["plan", "{WRONG}"], kind) for kind in ["missing yaml", "corrupt yaml"]],
    *[(["doctor", "{WRONG}"], kind) for kind in ["missing yaml", "corrupt yaml"]],
    *[
        (["train", RECIPE, "--output-dir", "{NEW}", "--set", "model.path={WRONG}"], kind)
        for kind in MODEL_FOLDER_KINDS
    ],
    *[
        (["data", RECIPE, "--set", "model.path={WRONG}"], kind)  # data reads the tokenizer, not the weights
        for kind in MODEL_FOLDER_KINDS
        if "weights" not in kind
    ],
    *[
        (["plan", RECIPE, "--set", "model.path={WRONG}"], kind)
        for kind in ["file", "empty folder", "config not json"]
    ],
    *[
        (["train", RECIPE, "--set", "data.path={WRONG}"], kind)
        for kind in ["missing jsonl", "folder", "corrupt jsonl"]
    ],
    *[(["train", RECIPE, "--output-dir", "{WRONG}"], kind) for kind in ["file", "under a file"]],
    *[
        (["train", RECIPE, "--output-dir", "{RUN}", "--resume-from", "{WRONG}"], kind)
        for kind in RUN_FOLDER_KINDS
    ],
    *[(["eval", "--adapter", "{WRONG}"], kind) for kind in RUN_FOLDER_KINDS],
    *[
        (["eval", "--adapter", "{RUN}", "--output", "{WRONG}"], kind)
        for kind in ["folder", "under a missing folder"]
    ],
    *[(["generate", "--adapter", "{WRONG}", "--prompt", "hi"], kind) for kind in RUN_FOLDER_KINDS],
    *[
        (["generate", "--adapter", "{RUN}", "--file", "{WRONG}"], kind)
        for kind in ["missing jsonl", "folder", "corrupt jsonl"]
    ],
    *[(["chat", "--adapter", "{WRONG}"], kind) for kind in RUN_FOLDER_KINDS],
    *[(["merge", "--adapter", "{WRONG}", "--out", "{NEW}"], kind) for kind in RUN_FOLDER_KINDS],
    *[
        (["merge", "--adapter", "{RUN}", "--out", "{WRONG}"], kind)
        for kind in ["file", "inside the adapter", "under a file"]
    ],
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A real finished run (2 steps) with a checkpoint, that bad commands must leave as it was."""
    from qlora_kit import train

    from .conftest import quick_recipe

    out = tmp_path_factory.mktemp("finished") / "run"
    train(quick_recipe(out, **{"train.max_steps": 2, "train.save_steps": 1}))
    return out


def make_wrong_path(kind: str, where: Path, run: Path) -> Path:
    path = where / "wrong"
    if kind.startswith("missing"):
        return where / ("nope.yaml" if "yaml" in kind else "nope.jsonl" if "jsonl" in kind else "nope")
    if kind in ("folder", "empty folder"):
        path.mkdir()
    elif kind == "file":
        path.write_text("not a folder\n")
    elif kind == "corrupt yaml":
        path = where / "bad.yaml"
        path.write_text("lora: [rank: : 3\n")
    elif kind == "corrupt jsonl":
        path = where / "bad.jsonl"
        path.write_text('{"prompt": "fine"}\n{"prompt": \n')
    elif kind in ("under a file", "under a missing folder"):
        (where / "plain").write_text("x") if kind == "under a file" else None
        return where / "plain" / "sub" / "out.json"
    elif kind == "inside the adapter":
        return run / "merged"
    elif kind in ("corrupt adapter config", "truncated adapter"):
        shutil.copytree(run, path)
        if kind == "corrupt adapter config":
            (path / "adapter_config.json").write_text("{not json")
        else:
            weights = path / "adapter_model.safetensors"
            weights.write_bytes(weights.read_bytes()[:100])
        return path
    elif kind == "model folder" or kind in MODEL_FOLDER_KINDS:
        from qlora_kit.model import builtin

        if kind == "adapter folder":
            return run
        shutil.copytree(builtin.ensure_tiny_model("tiny-llama"), path)
        if kind == "config not json":
            (path / "config.json").write_text("{")
        elif kind == "config without weights":
            for weights in path.glob("*.safetensors"):
                weights.unlink()
        elif kind == "truncated weights":
            weights = next(path.glob("*.safetensors"))
            weights.write_bytes(weights.read_bytes()[:1000])
        elif kind == "no tokenizer":
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json"):
                (path / name).unlink(missing_ok=True)
    return path


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` and a hash of its bytes."""
    import hashlib

    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.endswith(".lock")
    }


@pytest.mark.slow
@pytest.mark.parametrize(("argv", "kind"), PATH_CASES, ids=[f"{' '.join(a)}[{k}]" for a, k in PATH_CASES])
def test_every_path_argument_pointed_at_something_wrong_is_one_line_and_exit_2(
    argv, kind, finished_run, tmp_path, monkeypatch, capsys
):
    """Always exit 2, one error line, no traceback; nothing written outside the command's own output,
    and the finished run it points at left byte for byte as it was."""
    monkeypatch.chdir(ROOT)
    wrong = make_wrong_path(kind, tmp_path, finished_run)
    before_run, before_tmp = snapshot(finished_run), snapshot(tmp_path)
    values = {"{WRONG}": str(wrong), "{RUN}": str(finished_run), "{NEW}": str(tmp_path / "new")}
    line = [values.get(a, a) for a in argv]
    line = [a.replace("{WRONG}", str(wrong)) for a in line]
    code, err = run_cli(line, monkeypatch, capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2, err[-2000:]
    assert len(errors) == 1 and "Traceback" not in err, err[-2000:]
    assert snapshot(finished_run) == before_run, "the finished run was changed"
    assert snapshot(tmp_path) == before_tmp, "something was written beside the command's input"


@pytest.mark.slow
def test_target_modules_that_match_nothing_list_the_models_linear_layers(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    argv = [
        "train",
        RECIPE,
        "--output-dir",
        str(tmp_path / "out"),
        "--set",
        "lora.target_modules=[qkv, dense]",
    ]
    code, err = run_cli(argv, monkeypatch, capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1, err[-2000:]
    assert errors[0].startswith("error: lora.target_modules: none of ['qkv', 'dense'] is a linear layer")
    assert "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in errors[0]
    assert not (tmp_path / "out").exists()


def test_a_budget_no_policy_fits_is_refused_with_the_knobs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    settings = ["--set", "memory.checkpointing=auto", "--set", "memory.budget_gb=0.001"]
    # the layout and the loss head set, not chosen: their choices (timed, planned) come before this
    # refusal and are proved in tests/test_layout.py and tests/test_loss_choice.py
    settings += ["--set", "data.packing=true", "--set", "memory.chunked_loss=true"]
    code, err = run_cli(
        ["train", RECIPE, "--output-dir", str(tmp_path / "out"), *settings], monkeypatch, capsys
    )
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1, err[-2000:]
    assert errors[0].startswith("error: memory.budget_gb: no checkpointing policy fits 0.001 GiB")
    for knob in (
        "train.micro_batch_size (16)",
        "data.max_seq_len (64)",
        "lora.rank (16)",
        "memory.over_budget",
    ):
        assert knob in errors[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_overwrite_with_a_run_that_fails_first_gives_the_earlier_run_back(
    finished_run, tmp_path, monkeypatch, capsys
):
    """--overwrite onto a finished run, and the new run's loss blows up before its first checkpoint:
    the earlier run is back, byte for byte."""
    monkeypatch.chdir(ROOT)
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    before = snapshot(run)
    blow_up = [
        "--set",
        "optimizer.name=adamw_torch",
        "--set",
        "optimizer.lr=1e20",
        "--set",
        "train.save_steps=null",
    ]
    argv = ["train", RECIPE, "--output-dir", str(run), "--overwrite", "--set", "train.max_steps=6", *blow_up]
    argv += ["--set", "train.eval_steps=null", "--set", "train.sample_prompts=0"]
    code, err = run_cli(argv, monkeypatch, capsys)
    assert code == 3, err[-2000:]  # the guard stopped it
    assert "the earlier run in" in err and "is back as it was" in err
    assert snapshot(run) == before
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["run"]


@pytest.mark.parametrize("field", ["data.path", "data.sources[0].path", "data.val_path"])
def test_an_output_folder_that_holds_the_runs_data_is_refused(field, tmp_path, monkeypatch, capsys):
    """--overwrite sets a folder's contents aside and deletes them once the run has its own: a folder
    holding data the run reads, under any of the recipe's data fields (a mixture's sources included), is
    refused before anything moves."""
    out = tmp_path / "out"
    out.mkdir()
    data = out / "rows.jsonl"
    data.write_text('{"instruction": "Say hi.", "output": "hi"}\n')
    elsewhere = tmp_path / "other.jsonl"
    elsewhere.write_text('{"instruction": "Say bye.", "output": "bye"}\n')
    section = {
        "data.path": {"path": str(data), "val_fraction": 0.0},
        "data.sources[0].path": {"sources": [{"path": str(data)}], "val_fraction": 0.0},
        "data.val_path": {"path": str(elsewhere), "val_path": str(data)},
    }[field]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"path": "builtin:tiny-llama"},
                "data": section,
                # one step: were the refusal broken, the run would fail this test in seconds, not minutes
                "train": {"output_dir": str(out), "sample_prompts": 0, "max_steps": 1, "eval_steps": None},
            }
        )
    )
    code, err = run_cli(["train", str(recipe), "--overwrite"], monkeypatch, capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1, err[-2000:]
    assert f"holds {field} {data}" in errors[0]
    assert data.exists() and sorted(p.name for p in out.iterdir()) == ["rows.jsonl"]


def test_a_tokenizer_larger_than_the_embeddings_is_one_line_before_the_weights(tmp_path, monkeypatch, capsys):
    """Special tokens added to a tokenizer without resizing the model: one line naming both sizes and the
    fix, not an index error in the first forward pass."""
    import shutil

    from transformers import AutoTokenizer

    from qlora_kit.model import builtin

    folder = tmp_path / "model"
    shutil.copytree(builtin.ensure_tiny_model("tiny-llama"), folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = len(tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>", "<|end_tool|>"]})
    tokenizer.save_pretrained(folder)
    argv = ["train", RECIPE, "--output-dir", str(tmp_path / "out"), "--set", f"model.path={folder}"]
    code, err = run_cli(argv, monkeypatch, capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1, err[-2000:]
    assert f"tokenizer has {rows + 2:,} tokens but the model's embeddings have {rows:,} rows" in errors[0]
    assert "resize_token_embeddings" in errors[0] and "Traceback" not in err


# Round 4's fields and the override parser, each wrong one line naming the field (issue 59)
@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("lora.router=3", "lora.router: input should be a valid boolean"),
        ("lora.dropout=1.5", "lora.dropout: must be >= 0 and < 1, or auto (got 1.5)"),
        ("lora.dropout=some", "lora.dropout: input should be a valid number"),
        ("memory.mlp_tiles=0", "memory.mlp_tiles: must be >= 1 or auto (got 0)"),
        ("memory.mlp_tiles=many", "memory.mlp_tiles: input should be a valid integer"),
        ("memory.offload_activations=maybe", "memory.offload_activations: input should be a valid boolean"),
        (
            "data.preflight.min_end_token_share=5",
            "data.preflight.min_end_token_share: must be <= 1.0 (got 5)",
        ),
        ("lora.target_modules=[q_proj, k_proj", "--set lora.target_modules: cannot parse value"),
        ("grpo.rewards=[{name: exact_match}", "--set grpo.rewards: cannot parse value"),
    ],
)
def test_round_four_fields_and_overrides_given_wrong_are_one_line(setting, message, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code, err = run_cli(["validate", RECIPE, "--set", setting], monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0] == f"error: {lines[0][7:]}", err
    assert message in lines[0], err


@pytest.mark.parametrize(
    ("values", "message"),
    [
        # feedback rows given to DPO, and pairs given to KTO: the objective names the formats it reads
        (
            {"train": {"objective": "dpo"}, "data": {"path": "builtin:demo-feedback", "format": "feedback"}},
            "data.format: train.objective dpo trains on preference pairs",
        ),
        (
            {"train": {"objective": "kto"}, "data": {"path": "builtin:demo-pairs", "format": "preference"}},
            "data.format: train.objective kto trains on answers labelled desirable or not",
        ),
        (
            {"train": {"objective": "grpo"}, "grpo": {"num_generations": 1}},
            "grpo.num_generations: must be >= 2",
        ),
    ],
)
def test_rows_of_another_objective_are_one_line_before_anything_is_written(
    values, message, tmp_path, monkeypatch, capsys
):
    """Refused when the recipe is read: a finished run that --overwrite names stays as it was."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(b"a finished run's adapter")
    before = snapshot(out)
    recipe = tmp_path / "recipe.yaml"
    values = {**values, "train": {**values["train"], "output_dir": str(out)}}
    recipe.write_text(yaml.safe_dump(values))
    code, err = run_cli(["train", str(recipe), "--overwrite"], monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert snapshot(out) == before


def png_header(width: int, height: int) -> bytes:
    """A PNG file that says it is ``width`` x ``height`` and holds no pixels: Pillow reads an image's size
    from its header chunk when it opens the file, before it decodes anything."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b""))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "cannot be read as an image"),
        (b"not an image at all\n", "cannot be read as an image"),
        # 40,000 x 40,000 pixels in 69 bytes: decoding it would take 4.8 GB
        (png_header(40_000, 40_000), "too large to decode safely"),
        (png_header(10_000, 10_000), "too large to decode safely"),  # above Pillow's warning bound
    ],
    ids=["empty", "text", "bomb", "over the warning bound"],
)
def test_an_image_file_that_cannot_be_decoded_safely_is_a_row_error(content, message, tmp_path):
    from qlora_kit.data import images
    from qlora_kit.data.segments import RowError

    file = tmp_path / "picture.png"
    file.write_bytes(content)
    with pytest.raises(RowError, match=f"^image picture.png: {message}"):
        images.open_image(file)


@pytest.mark.slow  # builds the tiny vision-language model's processor
@pytest.mark.parametrize("image", ["https://example.com/cat.png", "empty.png", "bomb.png"])
def test_a_bad_image_in_the_data_is_one_line_naming_the_file_and_row(image, tmp_path, monkeypatch, capsys):
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "bomb.png").write_bytes(png_header(40_000, 40_000))
    rows = [
        {"messages": [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image", "path": image}, {"type": "text", "text": "What?"}],
                },
                {"role": "assistant", "content": "A square."},
            ]
        },
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(ROOT)
    argv = ["data", "recipes/demo-vlm.yaml", "--set", f"data.path={data}", "--set", "data.val_fraction=0"]
    argv += ["--set", "train.eval_steps=null"]
    code, err = run_cli(argv, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "row 2" in lines[0] and ("no downloads" in lines[0] or "decode" in lines[0] or "read" in lines[0])


@pytest.mark.slow  # plans the demo at each length it tries (~5 s)
def test_plan_max_seq_len_where_nothing_fits_is_one_line(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    argv = ["plan", RECIPE, "--max-seq-len", "--budget-gb", "0.001"]
    code, err = run_cli(argv, monkeypatch, capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1, err
    assert errors[0].startswith("error: plan --max-seq-len: not even 1024 tokens fit 0.001 GiB")


@pytest.mark.slow  # loads the run's model (the loading is the check's order, not its cost)
def test_generate_with_an_image_on_a_text_only_run_is_one_line(finished_run, tmp_path, monkeypatch, capsys):
    """An image given to a run whose base reads no images: one line naming --image, nothing generated."""
    from PIL import Image

    picture = tmp_path / "square.png"
    Image.new("RGB", (8, 8), "red").save(picture)
    argv = ["generate", "--adapter", str(finished_run), "What colour?", "--image", str(picture)]
    code, out, err = run_cli_output(argv, monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert (
        code == 2
        and lines[-1] == "error: --image: the adapter's base model is text-only (not a vision-language model)"
    ), err
    assert out.strip() in ("", "> What colour?") and "Traceback" not in err  # the prompt, no completion


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["--budget-gb", "-4"], "error: --budget-gb: must be > 0.0 (got -4.0), as memory.budget_gb"),
        (["--budget-gb", "0"], "error: --budget-gb: must be > 0.0 (got 0.0), as memory.budget_gb"),
        (["--max-seq-len", "--budget-gb", "-4"], "error: --budget-gb: must be > 0.0 (got -4.0)"),
        (["--max-seq-len", "--budget-gb", "0"], "error: --budget-gb: must be > 0.0 (got 0.0)"),
        (["--batch", "0"], "error: --batch: must be > 0 (got 0), as train.micro_batch_size"),
        (["--seq", "-3"], "error: --seq: must be > 0 (got -3), as data.max_seq_len"),
        (["--processes", "0"], "error: --processes: must be >= 1 (got 0)"),
    ],
)
def test_plan_numbers_out_of_range_are_one_line_as_the_recipes_fields_are(argv, line, monkeypatch, capsys):
    """A budget of -4 GiB or 0 is refused as memory.budget_gb: -4 is, before anything is planned."""
    monkeypatch.chdir(ROOT)
    code, out, err = run_cli_output(["plan", RECIPE, *argv], monkeypatch, capsys)
    assert code == 2 and err.strip().startswith(line) and len(err.strip().splitlines()) == 1, err
    assert out == ""


def test_every_numeric_option_of_every_command_is_checked():
    """Each int or float option of the CLI is declared with a Checked (recipe/options.py): its recipe
    field's validation, its own bounds, or the named check that takes it, so a new option cannot skip it."""
    import inspect
    import typing

    from qlora_kit.cli.app import app
    from qlora_kit.cli.exits import numeric_options
    from qlora_kit.recipe.options import Checked

    unchecked, seen = [], 0
    for command in [
        *app.registered_commands,
        *(c for g in app.registered_groups for c in g.typer_instance.registered_commands),
    ]:
        function = inspect.unwrap(command.callback)
        checked = numeric_options(function)
        for name, hint in typing.get_type_hints(function, include_extras=True).items():
            base = typing.get_args(hint)[0] if hasattr(hint, "__metadata__") else hint
            if {int, float} & (set(typing.get_args(base)) or {base}):
                seen += 1
                if not isinstance(checked.get(name), Checked):
                    unchecked.append(f"{command.callback.__name__} {name}")
    assert seen >= 13 and unchecked == []


USER = [{"role": "user", "content": "Hi"}]
ASSISTANT = [{"role": "assistant", "content": "Hello"}]
# one row of each format's shape (tests/test_bad_input.py checks the formats table holds no other)
ROW_OF = {
    "alpaca": {"instruction": "Say hi.", "input": "", "output": "Hi."},
    "chat": {"messages": USER + ASSISTANT},
    "sharegpt": {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]},
    "completion": {"prompt": "Hi", "completion": "Hello"},
    "text": {"text": "Hello there."},
    "preference": {"prompt": "Hi", "chosen": "Hello", "rejected": "Go"},
    "preference_alpaca": {"instruction": "Hi", "chosen": "Hello", "rejected": "Go"},
    "preference_chat": {
        "prompt": USER,
        "chosen": ASSISTANT,
        "rejected": [{"role": "assistant", "content": "Go"}],
    },
    "feedback": {"prompt": "Hi", "completion": "Hello", "label": True},
    "feedback_chat": {"prompt": USER, "completion": ASSISTANT, "label": True},
}
OBJECTIVE_OF = {"sequences": "sft", "pairs": "dpo", "unpaired": "kto"}


def format_pairs():
    from qlora_kit.registries.formats import FORMATS

    assert set(ROW_OF) == set(FORMATS), "a format without a row of its shape here"
    return [
        pytest.param(given, shaped, id=f"{shaped}-under-{given}")
        for given, spec in FORMATS.items()
        for shaped, other in FORMATS.items()
        if shaped != given and other.rows == spec.rows
    ]


@pytest.mark.parametrize(("given", "shaped"), format_pairs())
def test_a_row_in_another_formats_shape_names_that_format(given, shaped, tmp_path, monkeypatch, capsys):
    """Under data.format GIVEN, a row of format SHAPED's shape (TRL's conversational feedback rows under
    feedback, say) is refused in one line that ends naming SHAPED; or read, where GIVEN reads it too (a
    chat format's prompt may be text)."""
    from qlora_kit.registries.formats import FORMATS

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(ROW_OF[shaped]) + "\n")
    objective = OBJECTIVE_OF[FORMATS[given].rows]
    sets = {"data.path": rows, "data.format": given, "train.objective": objective, "data.packing": "false"}
    sets |= {"train.eval_steps": "null"}
    argv = ["data", str(ROOT / RECIPE)] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    code, _, err = run_cli_output(argv, monkeypatch, capsys)
    if code == 0:
        assert FORMATS[given].chat_template and not FORMATS[shaped].chat_template, err
        return
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    chat, was_chat = FORMATS[shaped].chat_template, FORMATS[given].chat_template
    what = "message lists" if chat and not was_chat else "text" if was_chat and not chat else "'"
    assert f"(data.format: {shaped} reads {what}" in lines[0] and lines[0].endswith(")"), err


def feedback_mixture(tmp_path: Path, second_format: str) -> dict:
    """A KTO recipe mixing the demo's labelled answers (format feedback) with a file of rows of
    ``second_format`` (its shape from ROW_OF), each source naming its own format; data.format unset."""
    rows = tmp_path / "second.jsonl"
    rows.write_text(
        "".join(json.dumps(ROW_OF[second_format] | {"label": n % 2 == 0}) + "\n" for n in range(8))
    )
    return {
        "data": {
            "sources": [
                {"path": "builtin:demo-feedback", "format": "feedback", "rows": 32},
                {"path": str(rows), "format": second_format},
            ],
            "max_seq_len": 64,
            "val_fraction": 0.0,
        },
        "quant": {"compute_dtype": "float32"},
        "lora": {"dropout": 0.0},
        "train": {
            "objective": "kto",
            "output_dir": str(tmp_path / "out"),
            "max_steps": 2,
            "micro_batch_size": 8,
            "eval_steps": None,
            "sample_prompts": 0,
        },
    }


@pytest.mark.slow  # two KTO steps on the tiny model (~5 s)
def test_a_kto_mixture_of_feedback_and_feedback_chat_sources_trains(tmp_path):
    """The objective's format check reads each source's format, not the defaulted data.format (red when it
    read data.format: "data.format: train.objective kto trains on answers labelled desirable or not: use
    feedback or feedback_chat (got alpaca)")."""
    from qlora_kit import train

    recipe = Recipe.from_dict(feedback_mixture(tmp_path, "feedback_chat"))
    assert recipe.data.format == "alpaca"  # the default, which no source reads
    result = train(recipe)
    assert (result.output_dir / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("second_format", ["alpaca", "preference"])
def test_a_source_whose_format_another_objective_needs_is_named(tmp_path, second_format):
    values = feedback_mixture(tmp_path, second_format)
    with pytest.raises(ValueError, match=r"data\.sources\[1\]\.format") as refused:
        Recipe.from_dict(values)
    assert f"(got {second_format})" in str(refused.value) and "data.format:" not in str(refused.value)
