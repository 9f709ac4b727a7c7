"""The ``qlora-kit`` command: one thin function per subcommand; the logic lives in the pipeline modules.

User mistakes (a bad recipe, bad data, an output folder that is in use) print one line and exit 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape  # a message's own brackets (data.sources[0], qlora-kit[wandb]) are text

from qlora_kit.cli import exporting, plan_views, recipes, talking, views
from qlora_kit.cli.exits import USER_ERROR, errors, user_errors
from qlora_kit.cli.logging_setup import configure_logging
from qlora_kit.errors import RecipeError
from qlora_kit.recipe import shipped
from qlora_kit.recipe.options import Checked
from qlora_kit.recipe.recipe import Recipe

app = typer.Typer(
    name="qlora-kit",
    help="QLoRA fine-tuning from a typed recipe: 4-bit base, LoRA, checkpointing, paged 8-bit AdamW.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(recipes.app)  # qlora-kit recipes [show|copy]
# The commands register in the order a run uses them, which is the order --help lists them.
console = Console()

RecipeArg = Annotated[
    Path,
    typer.Argument(help="A recipe YAML file, or a shipped recipe's name (qlora-kit recipes), e.g. demo."),
]
SetOpt = Annotated[
    list[str] | None, typer.Option("--set", help="Override a field: --set lora.rank=16 (repeatable).")
]
OutputOpt = Annotated[Path | None, typer.Option("--output-dir", help="Overrides train.output_dir.")]


def load_recipe(path: Path, overrides: list[str] | None, output_dir: Path | None = None) -> Recipe:
    recipe = Recipe.from_yaml(shipped.resolve(path), overrides=overrides or [])
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
    resume: Annotated[
        bool, typer.Option("--resume", help="Continue from the newest complete checkpoint in the output dir.")
    ] = False,
    resume_from: Annotated[
        Path | None, typer.Option("--resume-from", help="Continue from this checkpoint folder.")
    ] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Only warnings, errors and the final summary.")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Debug lines of qlora_kit and transformers' info.")
    ] = False,
) -> None:
    """Fine-tune: load the 4-bit base, attach LoRA, train on the Trainer, save the adapter."""
    from rich.console import Console

    from qlora_kit.training.pipeline import run

    configure_logging(errors, -1 if quiet else 1 if verbose else 0)
    progress = Console(stderr=True, quiet=True) if quiet else errors
    recipe_ = load_recipe(recipe, set_, output_dir)
    from qlora_kit.errors import TrainingGuardError
    from qlora_kit.model.driver import unusable_gpu

    problem = unusable_gpu()  # a GPU nvidia-smi sees but torch cannot use: say why before a CPU run
    if problem is not None:
        raise TrainingGuardError(problem)
    result = run(recipe_, overwrite=overwrite, resume=resume_from or resume, console=progress)
    if result.main_process:
        views.show_run(console, result)


@app.command()
@user_errors
def validate(
    recipe: RecipeArg,
    set_: SetOpt = None,
    output_dir: OutputOpt = None,
    accelerate_config: Annotated[
        Path | None,
        typer.Option("--accelerate-config", help="Check the recipe against this accelerate config (FSDP)."),
    ] = None,
) -> None:
    """Load a recipe, apply overrides, and print every resolved value."""
    from qlora_kit.training.distributed import (
        check_fsdp_launch,
        fsdp_settings_of,
        launched_fsdp_settings,
    )

    resolved = load_recipe(recipe, set_, output_dir)
    resolved.check_paths()
    launch = fsdp_settings_of(accelerate_config) if accelerate_config else launched_fsdp_settings()
    check_fsdp_launch(resolved, launch)
    from qlora_kit.training.watch.trackers import check_installed

    missing = check_installed(resolved.train.report_to)
    if missing:
        raise RecipeError(missing)
    console.print(f"# {recipe}: valid", style="green", highlight=False, markup=False, soft_wrap=True)
    console.print(resolved.to_yaml(), highlight=False, markup=False)


@app.command("data")
@user_errors
def show_data(
    recipe: RecipeArg,
    set_: SetOpt = None,
    examples: Annotated[
        int, typer.Option(help="How many rendered examples to show."), Checked("--examples", bounds={"ge": 0})
    ] = 3,
) -> None:
    """Show what training will see: examples with the trained part marked, lengths, truncation, padding."""
    configure_logging(errors)
    from qlora_kit.data.preflight import enforce
    from qlora_kit.data.report import inspect_data
    from qlora_kit.model.loading import load_tokenizer

    resolved = load_recipe(recipe, set_)
    view = inspect_data(resolved, load_tokenizer(resolved.model), count=examples)
    views.show_data(console, view, resolved)
    if resolved.data.preflight.enabled:
        enforce(view.checks)  # a failed check: its line and exit code 2, as `train` would stop


@app.command()
@user_errors
def plan(
    recipe: RecipeArg,
    set_: SetOpt = None,
    budget_gb: Annotated[
        float | None,
        typer.Option("--budget-gb", help="Show which policies fit this many GiB."),
        Checked("--budget-gb", "memory.budget_gb"),
    ] = None,
    batch: Annotated[
        int | None,
        typer.Option(help="Rows per micro-batch (default: the recipe's)."),
        Checked("--batch", "train.micro_batch_size"),
    ] = None,
    seq: Annotated[
        int | None,
        typer.Option(help="Tokens per row (default: data.max_seq_len)."),
        Checked("--seq", "data.max_seq_len"),
    ] = None,
    device: Annotated[str, typer.Option(help="cuda or cpu: the autocast and dropout masks differ.")] = "cuda",
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON (sizes in bytes).")] = False,
    processes: Annotated[
        int,
        typer.Option(help="GPUs the run is launched on (train.fsdp shards over them)."),
        Checked("--processes", bounds={"ge": 1}),
    ] = 1,
    with_data: Annotated[
        bool | None,
        typer.Option(
            "--with-data/--no-data",
            help="Read the recipe's data (tokenized, cached for the run) and plan the batch the run will have: "
            "the layout data.packing chooses, the longest row, a padding mask only where rows differ in "
            "length, the chunked head's largest trained share (default: when the model and data are "
            "builtin or local and no --batch/--seq/--padded is given).",
        ),
    ] = None,
    padded: Annotated[
        bool | None,
        typer.Option(
            "--padded/--no-padded",
            help="Without the data: plan rows padded with their attention mask (the default, the larger), "
            "or rows of one length (no mask).",
        ),
    ] = None,
    max_seq_len: Annotated[
        bool,
        typer.Option(
            "--max-seq-len",
            help="Find the longest row (micro-batch 1) that fits --budget-gb (or memory.budget_gb) for each "
            "of checkpointing none / selective / full, full + offload, full + offload + MLP tiles.",
        ),
    ] = False,
) -> None:
    """Predict peak memory per GPU from the model config (and, where readable, the batch its data makes),
    for every checkpointing policy."""
    resolved = load_recipe(recipe, set_)
    if max_seq_len:
        from qlora_kit.memory.max_length import STEP, longest_fits

        room = budget_gb or resolved.memory.budget_gb
        if room is None:
            raise RecipeError("plan --max-seq-len: give --budget-gb or set memory.budget_gb (the GiB to fit)")
        fits = longest_fits(resolved, room, device)
        if not any(fit.seq for fit in fits):
            least = min(fit.device_peak for fit in fits) / 2**30
            raise RecipeError(
                f"plan --max-seq-len: not even {STEP} tokens fit {room:g} GiB with any checkpointing policy "
                f"(the smallest plan needs {least:.2f} GiB): raise --budget-gb (or memory.budget_gb)"
            )
        plan_views.show_longest_fits(console, fits, resolved, room)
        return
    from qlora_kit.training.recipe_plan import plan_recipe

    planned = plan_recipe(resolved, device, budget_gb, batch, seq, processes, with_data, padded)
    if as_json:
        print(json.dumps(plan_views.plan_as_dict(planned, budget_gb), indent=2))
        return
    plan_views.show_plan(console, planned, budget_gb)


@app.command("eval")
@user_errors
def eval_command(
    recipe: Annotated[
        Path | None, typer.Argument(help="Recipe (default: the one saved with the adapter).")
    ] = None,
    adapter: Annotated[
        Path | None, typer.Option("--adapter", help="Folder written by qlora-kit train.")
    ] = None,
    no_adapter: Annotated[bool, typer.Option("--no-adapter", help="Evaluate the base model alone.")] = False,
    set_: SetOpt = None,
    max_examples: Annotated[
        int | None,
        typer.Option(help="Evaluate on the first N validation rows."),
        Checked("--max-examples", bounds={"gt": 0}),
    ] = None,
    output: Annotated[
        Path | None, typer.Option(help="JSON results file (default: ADAPTER/eval.json).")
    ] = None,
) -> None:
    """Loss, perplexity and exact-match accuracy on the validation set, as a table and as JSON."""
    configure_logging(errors)
    from qlora_kit.after.evaluate import evaluate

    if recipe is None and (adapter is None or no_adapter):
        raise RecipeError("eval: give a RECIPE, or --adapter DIR to use the recipe saved with it")
    resolved = load_recipe(recipe, set_) if recipe is not None else None
    if not no_adapter and adapter is None:
        raise RecipeError("eval: --adapter DIR is required (or --no-adapter for the base model alone)")
    adapter_dir = None if no_adapter else adapter
    output = output or (adapter_dir / "eval.json" if adapter_dir is not None else None)
    if output is not None:
        from qlora_kit.model.paths import check_output_file

        check_output_file(output.expanduser().resolve(), "--output")
    results = evaluate(resolved, adapter_dir, max_examples=max_examples, output=output)
    views.show_eval(console, results, "the base model alone" if no_adapter else str(adapter))
    if output is not None:
        console.print(f"results written to {output}", highlight=False, markup=False)


talking.register(app)  # qlora-kit generate, qlora-kit chat


@app.command()
@user_errors
def show(
    run_dir: Annotated[Path, typer.Argument(help="A run's output folder (train.output_dir).")],
    plot: Annotated[
        bool, typer.Option(help="Write loss.png (losses and learning rate against the step) into it.")
    ] = True,
) -> None:
    """A run at a glance: what its recipe changed, losses, evaluations, speed, memory, versions; loss.png."""
    from qlora_kit.cli.views import show_run_folder as show_run

    show_run(run_dir, console, plot=plot)


exporting.register(app)  # qlora-kit merge, qlora-kit export


@app.command()
@user_errors
def doctor(
    recipe: Annotated[
        Path | None, typer.Argument(help="Also plan this recipe against the device's free memory.")
    ] = None,
    set_: SetOpt = None,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose", "-v", help="Show the tiny run as qlora-kit train does (its log and progress)."
        ),
    ] = False,
) -> None:
    """Prove this machine: versions, device, a short real training run on it, reload, merge; exit 1 on a failure."""
    # the table is the answer: the tiny run's lines only with -v, through the run console as train shows them
    configure_logging(errors, 0 if verbose else -1)
    from qlora_kit.cli.doctor import diagnose

    resolved = load_recipe(recipe, set_) if recipe is not None else None
    checks = diagnose(resolved, console=errors if verbose else None)
    views.show_doctor(console, checks)
    if not all(check.ok for check in checks):
        raise typer.Exit(1)


def main() -> None:
    try:
        run_command()
    finally:
        # On every exit, error or not: the ranks of a launched run joined a process group. A command
        # that never imported torch joined none, and --help stays quick.
        if "torch.distributed" in sys.modules:
            from qlora_kit.training.distributed import leave_process_group

            leave_process_group()


def run_command() -> None:
    # Typer's own usage errors (an unknown flag, a missing argument, a value of the wrong type) become
    # one line and exit code 2, like every other mistake a user can make.
    command = typer.main.get_command(app)
    try:
        code = command.main(prog_name="qlora-kit", standalone_mode=False)
    except typer.Abort:
        sys.exit(130)
    except Exception as exc:
        # Duck-typed: typer vendors its own copy of click's UsageError.
        if getattr(exc, "exit_code", None) != USER_ERROR or not hasattr(exc, "format_message"):
            raise
        if not exc.format_message().strip():
            sys.exit(0)  # no arguments at all: the help was shown
        context = getattr(exc, "ctx", None)
        where = f"{context.command_path}: " if context is not None else ""
        errors.print(
            f"[bold red]error:[/] {escape(where + exc.format_message())}", highlight=False, soft_wrap=True
        )
        sys.exit(USER_ERROR)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    sys.exit(main())
