"""How the CLI shows results: rich tables and lines for a run, the data view, an evaluation, a machine's
checks and an export (the plan's: plan_views.py).

Kept apart from cli.py so the command functions stay one screen each and hold no rendering.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from qlora_kit.registries import metric_keys as keys
from qlora_kit.training.run_folder.run_record import (
    memory_rows,
    metric_rows,
    oom_rows,
    plot_run,
    read_run,
    recipe_changes,
    speed_rows,
)
from qlora_kit.training.run_folder.run_record import summary_rows as record_rows

if TYPE_CHECKING:
    from rich.console import Console

    from qlora_kit.cli.doctor import Check
    from qlora_kit.data.report import DataView
    from qlora_kit.recipe.recipe import Recipe
    from qlora_kit.training.pipeline import TrainResult
    from qlora_kit.training.run_folder.run_record import RunRecord


def plain(value: object) -> Text:
    """A cell of a user's data, a model's output, a path or a template: text, never rich markup (a
    Mistral prompt's ``[/INST]`` is a closing tag to rich, and a traceback after a finished run)."""
    return Text(str(value))


def show_run(console: Console, result: TrainResult) -> None:
    """The run's summary table, the sample answers before and after, and where it all went."""
    table = Table(title="run summary", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    for name, value in summary_rows(result):
        table.add_row(plain(name), plain(value))
    console.print(table)
    if result.samples:
        table = Table(title="Answers before and after fine-tuning")
        for column in ("prompt", "reference", "before", "after"):
            table.add_column(column, overflow="fold")
        for row in result.samples:
            cells = (_question(row["prompt"]), row["reference"], row["before"] or "''", row["after"] or "''")
            table.add_row(*(plain(cell) for cell in cells))
        console.print(table)
    console.print(f"adapter written to [bold]{escape(str(result.output_dir))}[/]", highlight=False)


def summary_rows(result: TrainResult) -> list[tuple[str, str]]:
    """(what, value) rows: steps, time, tokens/s, losses, eval losses, peak memory, the output folder."""
    usage, rows = result.memory, []
    rows.append(("steps", str(result.steps)))
    if keys.TRAIN_SECONDS in usage:
        rows.append(("training time", f"{usage[keys.TRAIN_SECONDS]:.1f} s"))
    rows += speed_rows(result.metrics)
    rows += metric_rows(result.metrics)
    rows += oom_rows(result.metrics)
    saved = [usage[keys.SAVED_MIB]] if keys.SAVED_MIB in usage else []
    rows += memory_rows([usage[key] for key in keys.PEAK_KEYS if key in usage], saved)
    rows.append(("written to", str(result.output_dir)))
    return rows


def show_record(console: Console, record: RunRecord) -> None:
    """``qlora-kit show``: the recipe's changes from the defaults, then the run's summary."""
    changes = Table(title="recipe: what differs from the defaults")
    for column in ("field", "default", "this run"):
        changes.add_column(column, overflow="fold")
    for name, default, value in recipe_changes(record.recipe):
        changes.add_row(plain(name), plain(default), plain(value))
    console.print(changes)
    table = Table(title="run", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    for name, value in record_rows(record):
        table.add_row(plain(name), plain(value))
    console.print(table)


def _question(prompt: str) -> str:
    # Show the question itself, not the prompt template around it.
    lines = [line for line in prompt.splitlines() if line and not line.startswith("###")]
    return " ".join(lines)


def show_data(console: Console, view: DataView, recipe: Recipe) -> None:
    for i, runs in enumerate(view.examples, start=1):
        console.rule(f"example {i} (trained text in [bold green]green[/], between ⟦ ⟧)")
        for text, trained in runs:
            style = "bold green" if trained else "dim"
            console.print(
                f"⟦{text}⟧" if trained else text, style=style, end="", markup=False, highlight=False
            )
        console.print()
    table = Table(title="token lengths (before truncation)")
    for name in view.percentiles:
        table.add_column(name, justify="right")
    table.add_row(*(str(v) for v in view.percentiles.values()))
    console.print(table)
    for report in view.reports:
        console.print(report.summary(), highlight=False, markup=False)
    shares = ", ".join(f"{mode} {share:.1%}" for mode, share in view.pad_share.items())
    console.print(f"pad tokens per batch of {recipe.train.micro_batch_size}: {shares}", highlight=False)
    if recipe.data.packing == "auto":
        console.print(
            f"data.packing auto: {view.auto_layout} pads least on this data (a run times the layouts and "
            "takes the most real tokens a second)",
            highlight=False,
        )
    checks = Table(title="preflight (data.preflight: what stops a run before training)")
    for column in ("check", "result", "measured"):
        checks.add_column(column, overflow="fold")
    for check in view.checks:
        result = "[green]pass[/]" if check.passed else "[bold red]FAIL[/]"
        detail = check.detail + ("" if check.passed else f" ({check.fix})")
        checks.add_row(plain(check.name), result, plain(detail))
    console.print(checks)


def show_eval(console: Console, results: dict[str, Any], subject: str) -> None:
    table = Table(title=f"evaluation of {escape(subject)}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    keys = ("loss", "perplexity", "exact_match", "tokens", "exact_match_examples")
    keys += ("preference_accuracy", "reward_margin", "likelihood_accuracy", "pairs", "reference")
    keys += ("desirable_share", "reference_desirable_share")  # labelled answers (train.objective kto)
    keys += ("reward_greedy", "reward_sampled", *sorted(k for k in results if k.startswith("rewards_")))
    keys += ("reward_prompts",)
    for key in keys:
        if key in results:
            value = results[key]
            table.add_row(plain(key), plain(f"{value:.4f}" if isinstance(value, float) else value))
    console.print(table)


def show_doctor(console: Console, checks: list[Check]) -> None:
    table = Table(title="qlora-kit doctor")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    for check in checks:
        table.add_row(
            plain(check.name), "[green]pass[/]" if check.ok else "[bold red]FAIL[/]", plain(check.detail)
        )
    console.print(table)
    failed = [check.name for check in checks if not check.ok]
    console.print(
        f"[bold red]{len(failed)} failed:[/] {escape(', '.join(failed))}"
        if failed
        else "[green]all checks passed[/]",
        highlight=False,
    )


def show_run_folder(run_dir: str | Path, console: Console, plot: bool = True) -> Path | None:
    """Print the run in ``run_dir`` (show_record) and, with ``plot``, write its loss.png; returns
    the plot's path. Without matplotlib installed, says so on the console and returns None."""
    record = read_run(run_dir)
    show_record(console, record)
    if not plot:
        return None
    if not record.rows_with("loss") and not record.rows_with("eval_loss"):
        # a run that has logged no step yet: an empty plot would only show matplotlib's default axes
        console.print("loss.png not written: the run has logged no loss yet (nothing to plot)", markup=False)
        return None
    try:
        written = plot_run(record)
    except ImportError:
        console.print(
            "loss.png not written: it needs matplotlib (pip install 'qlora-kit[plot]')", markup=False
        )
        return None
    console.print(f"loss plot written to [bold]{escape(str(written))}[/]", highlight=False)
    return written


def show_export(console: Console, report: dict) -> None:
    """The parity report of ``qlora-kit export``: one row per reader and comparison; KL at the answer
    positions and top-1 at the decided ones (teacher forcing: parity.DECIDED) are judged against the floor
    of the export's type, the free-running greedy agreement is shown."""
    source = report.get("prompts_from", "validation rows")
    table = Table(
        title=f"parity: {report['prompts']} prompts from the {source}, {report['tokens']} greedy tokens each"
    )
    for column in (
        "export",
        "reader",
        "against",
        "top-1",
        "mean KL",
        "allowed",
        "greedy",
        "prompt",
        "template",
    ):
        table.add_column(column)
    for c in report["comparisons"]:
        marks = {True: "same", False: "DIFFERS", None: "-"}
        allowed = c.get("floor")
        counted = c.get(
            "decided", c.get("positions")
        )  # positions top-1 was counted at (an older report: all)
        table.add_row(
            plain(c["export"]),
            plain(c["reader"]),
            plain(c["against"]),
            f"{c['top1_agreement']:.1%}" + (f" of {counted}" if counted is not None else ""),
            f"{c['mean_kl']:.3g}",
            f">= {allowed['min_top1']:.1%}, <= {allowed['max_kl']:.3g}" if allowed else "-",
            f"{c['greedy_agreement']:.1%}",
            marks[c["prompt_ids_match"]],
            marks[c["template_match"]],
        )
    console.print(table)
    for line in report.get("greedy_causes", []):
        console.print(line, highlight=False, markup=False)
    difference = report.get("base_difference")
    if difference:
        console.print(
            f"merged onto {report['onto']} weights; the dequantized 4-bit base differs from the original "
            f"16-bit one by {difference['mean_relative']:.2%} (mean relative, {difference['layers']} layers)",
            highlight=False,
        )
