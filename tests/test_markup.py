"""A user's text reaches rich as text, never as markup: data, a model's output, a path or a template that
holds ``[/INST]`` (a closing tag to rich: MarkupError, a traceback after a finished run), ``[bold]`` (a
style) or ``[link=x]`` (a hyperlink) is printed as it is, in every view."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from qlora_kit import Recipe
from qlora_kit.cli import views
from qlora_kit.cli.doctor import Check
from qlora_kit.data.report import inspect_data
from qlora_kit.training.pipeline import TrainResult
from qlora_kit.training.run_folder.run_record import RunRecord

from .conftest import run_cli_output

MARKUP = "[INST] Say hi [/INST] [bold]hi[/bold] [link=x]there"
TAGS = ("[/INST]", "[bold]", "[link=x]")


def printed(show, *args) -> str:
    console = Console(file=io.StringIO(), width=400, color_system=None)
    show(console, *args)
    return console.file.getvalue()


def assert_shown_as_typed(text: str, count: int = 1) -> None:
    for tag in TAGS:
        assert text.count(tag) >= count, f"{tag} not shown as typed in:\n{text}"


def test_the_run_summary_and_the_answers_before_and_after(tmp_path):
    samples = [{"prompt": MARKUP, "reference": MARKUP, "before": MARKUP, "after": MARKUP}]
    result = TrainResult(tmp_path / MARKUP, [], model=None, tokenizer=None, samples=samples)
    assert_shown_as_typed(printed(views.show_run, result), count=5)  # 4 answers' cells and the folder


def test_the_data_view(tokenizer, tmp_path):
    rows = [{"instruction": MARKUP, "input": "", "output": MARKUP} for _ in range(4)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    recipe = Recipe.from_dict({"data": {"path": str(path), "system_prompt": MARKUP}})
    assert_shown_as_typed(printed(views.show_data, inspect_data(recipe, tokenizer), recipe), count=2)


def test_the_evaluation_doctor_record_and_export_views(tmp_path):
    assert_shown_as_typed(printed(views.show_eval, {"loss": 1.0, "reference": MARKUP}, MARKUP), count=2)
    assert_shown_as_typed(printed(views.show_doctor, [Check(MARKUP, False, MARKUP)]), count=3)
    record = RunRecord(tmp_path, {"data": {"system_prompt": MARKUP}}, {"output_dir": MARKUP}, [])
    assert_shown_as_typed(printed(views.show_record, record))
    comparison = {"export": MARKUP, "reader": MARKUP, "against": MARKUP, "max_abs_logit": 0.0}
    comparison |= {"mean_abs_logit": 0.0, "greedy_agreement": 1.0, "prompt_ids_match": True}
    comparison |= {"top1_agreement": 1.0, "mean_kl": 0.0, "floor": {"min_top1": 0.98, "max_kl": 0.002}}
    report = {"prompts": 1, "tokens": 1, "comparisons": [comparison | {"template_match": None}]}
    assert_shown_as_typed(printed(views.show_export, report), count=3)


def test_error_and_validate_lines_show_a_path_as_typed(tmp_path, monkeypatch, capsys):
    missing = tmp_path / f"{MARKUP}.yaml"
    code, _, err = run_cli_output(["validate", str(missing)], monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err
    assert_shown_as_typed(err.replace("\n", ""))
    recipe = tmp_path / "[bold]ok[link=x].yaml"  # a file name holds no "/": [/INST] is in the recipe
    recipe.write_text(f"data:\n  system_prompt: '{MARKUP}'\n", encoding="utf-8")
    code, out, err = run_cli_output(["validate", str(recipe)], monkeypatch, capsys)
    assert code == 0, err
    assert out.startswith(f"# {recipe}: valid")
    assert_shown_as_typed(out)


@pytest.mark.slow
def test_generate_echoes_a_prompt_as_typed(finished_run, monkeypatch, capsys):
    """Through the CLI on a trained run: the prompt generate echoes before its answer."""
    code, out, err = run_cli_output(
        ["generate", "--adapter", str(finished_run), "--max-new-tokens", "2", MARKUP], monkeypatch, capsys
    )
    assert code == 0 and "Traceback" not in err, err
    assert_shown_as_typed(out)
