"""The ``qlora-kit`` command: one thin function per subcommand; the logic lives in the pipeline modules.

User mistakes (a bad recipe, bad data, an output folder that is in use) print one line and exit 2.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from qlora_kit.recipe import Recipe, RecipeError

app = typer.Typer(
    name="qlora-kit",
    help="QLoRA fine-tuning from a typed recipe: 4-bit base, LoRA, checkpointing, paged 8-bit AdamW.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
errors = Console(stderr=True)
USER_ERROR = 2

RecipeArg = Annotated[Path, typer.Argument(help="Recipe YAML file, e.g. recipes/demo.yaml.")]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override a field: --set lora.rank=16 (repeatable).")
]
OutputOpt = Annotated[Path | None, typer.Option("--output-dir", help="Overrides train.output_dir.")]


def user_errors(command):
    """Turn a user's mistake into one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from qlora_kit.data import DataError
        from qlora_kit.outputs import OutputDirError

        try:
            return command(*args, **kwargs)
        except (RecipeError, DataError, OutputDirError) as exc:
            errors.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(USER_ERROR) from None

    return wrapper


def load_recipe(path: Path, overrides: list[str] | None, output_dir: Path | None = None) -> Recipe:
    recipe = Recipe.from_yaml(path, overrides=overrides or [])
    if output_dir is not None:
        recipe = recipe.with_overrides({"train.output_dir": str(output_dir)})
    return recipe


@app.command()
@user_errors
def train(
    recipe: RecipeArg,
    set_: SetOpt = None,
    output_dir: OutputOpt = None,
    overwrite: Annotated[
        bool, typer.Option(help="Replace what an earlier run left in the output dir.")
    ] = False,
) -> None:
    """Fine-tune: load the 4-bit base, attach LoRA, train on the Trainer, save the adapter."""
    from qlora_kit.pipeline import run

    _configure_logging()
    result = run(load_recipe(recipe, set_, output_dir), overwrite=overwrite)
    _print_summary(result)


@app.command()
@user_errors
def validate(recipe: RecipeArg, set_: SetOpt = None, output_dir: OutputOpt = None) -> None:
    """Load a recipe, apply overrides, and print every resolved value."""
    resolved = load_recipe(recipe, set_, output_dir)
    console.print(f"# {recipe}: valid", style="green", highlight=False)
    console.print(resolved.to_yaml(), highlight=False, markup=False)


@app.command("data")
@user_errors
def show_data(
    recipe: RecipeArg,
    set_: SetOpt = None,
    examples: Annotated[int, typer.Option(help="How many rendered examples to show.")] = 3,
) -> None:
    """Show what training will see: examples with the trained part marked, lengths, truncation, padding."""
    from qlora_kit.data_report import inspect_data
    from qlora_kit.model import load_tokenizer

    resolved = load_recipe(recipe, set_)
    view = inspect_data(resolved, load_tokenizer(resolved.model), count=examples)
    for i, runs in enumerate(view.examples, start=1):
        console.rule(f"example {i} (trained text in [bold green]green[/], between ⟦ ⟧)")
        for text, trained in runs:
            console.print(
                f"⟦{text}⟧" if trained else text,
                style="bold green" if trained else "dim",
                end="",
                markup=False,
                highlight=False,
            )
        console.print()
    table = Table(title="token lengths (before truncation)")
    for name in view.percentiles:
        table.add_column(name, justify="right")
    table.add_row(*(str(v) for v in view.percentiles.values()))
    console.print(table)
    for report in view.reports:
        console.print(report.summary(), highlight=False)
    batch = resolved.train.micro_batch_size
    shares = ", ".join(f"{mode} {share:.1%}" for mode, share in view.pad_share.items())
    console.print(f"pad tokens per batch of {batch}: {shares}", highlight=False)


def _print_summary(result) -> None:
    losses = result.eval_losses
    if len(losses) >= 2:
        console.print(
            f"eval loss: {losses[0]:.4f} -> {losses[-1]:.4f} ({losses[-1] / losses[0]:.1%} of the first)"
        )
    if result.samples:
        table = Table(title="Answers before and after fine-tuning")
        for column in ("prompt", "reference", "before", "after"):
            table.add_column(column, overflow="fold")
        for row in result.samples:
            table.add_row(
                _question(row["prompt"]), row["reference"], row["before"] or "''", row["after"] or "''"
            )
        console.print(table)
    console.print(f"adapter written to [bold]{result.output_dir}[/]", highlight=False)


def _question(prompt: str) -> str:
    # Show the question itself, not the prompt template around it.
    lines = [line for line in prompt.splitlines() if line and not line.startswith("###")]
    return " ".join(lines)


def _configure_logging() -> None:
    from rich.logging import RichHandler

    handler = RichHandler(console=errors, show_path=False, show_time=False, markup=False)
    logging.basicConfig(level=logging.WARNING, format="%(message)s", handlers=[handler], force=True)
    logging.getLogger("qlora_kit").setLevel(logging.INFO)


def main() -> None:
    app(prog_name="qlora-kit")


if __name__ == "__main__":
    sys.exit(main())
