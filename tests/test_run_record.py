"""`qlora-kit show` and `qlora_kit.show`: a run read back from its folder, and its loss.png."""

import json
import subprocess
import sys

import pytest
from rich.console import Console

from qlora_kit import Recipe
from qlora_kit.cli.views import show_run_folder as show
from qlora_kit.cli.views import summary_rows as views_summary
from qlora_kit.errors import OutputDirError
from qlora_kit.training.run_folder.run_record import plot_run, read_run, recipe_changes, summary_rows


def test_recipe_changes_are_exactly_the_fields_set_away_from_the_defaults():
    recipe = Recipe.from_dict(
        {"lora": {"rank": 8}, "train": {"max_steps": 5}, "optimizer": {"lr": 2e-4}}  # lr: the default
    )
    assert recipe_changes(recipe.resolved_values()) == [
        ("lora.rank", 16, 8),
        ("train.max_steps", None, 5),
    ]
    # a 16-bit recipe's 4-bit-only fields keep their defaults: they are no change
    assert recipe_changes(Recipe.from_dict({"quant": {"bits": 16}}).resolved_values()) == [
        ("quant.bits", 4, 16)
    ]


@pytest.mark.slow  # trains: the fast tier (-m 'not slow') trains nothing
def test_show_reads_back_what_the_run_logged(finished_run, tmp_path):
    record = read_run(finished_run)
    logged = [json.loads(line) for line in (finished_run / "metrics.jsonl").read_text().splitlines()]
    assert record.finished and record.metrics == logged
    rows = dict(summary_rows(record))
    losses = [row["loss"] for row in logged if "loss" in row]
    assert len(losses) == 2 and rows["loss, first -> last"] == f"{losses[0]:.4f} -> {losses[-1]:.4f}"
    assert rows["state"] == "finished, 4 steps"
    assert "torch" in rows["versions"]
    changed = dict((name, value) for name, _, value in recipe_changes(record.recipe))
    assert changed["train.max_steps"] == 4 and changed["train.output_dir"] == str(finished_run)

    console = Console(record=True, width=200)
    written = show(finished_run, console, plot=False)
    assert written is None and not (finished_run / "loss.png").exists()
    text = console.export_text()
    assert "train.max_steps" in text and rows["loss, first -> last"] in text

    picture = plot_run(record, tmp_path / "loss.png")
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 10_000


@pytest.mark.slow  # trains
def test_the_train_summary_and_show_give_one_tokens_per_s(trained_run):
    """One tokens/s for one run: the train summary prints what `show` reads back from metrics.jsonl."""
    shown = dict(summary_rows(read_run(trained_run.output_dir)))
    speed = [value for name, value in shown.items() if name.startswith("tokens/s")]
    trained = [value for name, value in views_summary(trained_run) if name.startswith("tokens/s")]
    assert len(speed) == 1 and speed == trained
    assert f"{trained_run.memory['tokens_per_s']:,.0f}" in speed[0]


def test_eval_rows_name_the_best_step(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"recipe": {}, "steps": 3}))
    lines = [{"step": 0, "eval_loss": 2.0}, {"step": 1, "loss": 1.0}, {"step": 2, "eval_loss": 0.5}]
    lines += [{"step": 3, "eval_loss": 0.75}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    rows = dict(summary_rows(read_run(tmp_path)))
    assert rows["eval loss, first -> best -> last"] == "2.0000 -> 0.5000 (step 2) -> 0.7500"
    assert rows["state"].startswith("not finished")


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "not a qlora-kit run folder (no manifest.json)"),
        ({"manifest.json": "[1]"}, "manifest.json: not a JSON object"),
        (
            {"manifest.json": "{}", "metrics.jsonl": '{"step": 1}\n{oops\n'},
            "metrics.jsonl:2: not a JSON object",
        ),
    ],
)
def test_a_folder_that_is_not_a_run_is_one_line(tmp_path, files, message):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises(OutputDirError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_run(tmp_path)


@pytest.mark.slow  # trains: the fast tier (-m 'not slow') trains nothing
def test_the_cli_without_matplotlib_prints_the_summary_and_says_how_to_get_the_plot(finished_run):
    # matplotlib is an extra: hidden from this process, show still prints and exits 0
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.argv = ['qlora-kit', 'show', sys.argv[1]];"
        "from qlora_kit.cli.app import main; main()"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(finished_run)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "loss, first -> last" in result.stdout
    assert "pip install 'qlora-kit[plot]'" in result.stdout
    assert not (finished_run / "loss.png").exists()


def test_show_on_a_run_that_has_logged_no_step_says_there_is_nothing_to_plot(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"recipe": {}}))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "lr": 0.0}) + "\n")  # no loss yet
    console = Console(record=True, width=200)
    assert show(tmp_path, console, plot=True) is None
    assert not (tmp_path / "loss.png").exists()
    assert "loss.png not written: the run has logged no loss yet (nothing to plot)" in console.export_text()
