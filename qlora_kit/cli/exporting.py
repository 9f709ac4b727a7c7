"""``qlora-kit merge`` and ``qlora-kit export``: a trained adapter made into a model to serve, checked.

Kept apart from app.py (one screen per command, the module under 400 lines); ``register`` adds both
commands to the ``qlora-kit`` app.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from qlora_kit.cli import views
from qlora_kit.cli.exits import GUARD_STOP, USER_ERROR, errors, user_errors
from qlora_kit.cli.logging_setup import configure_logging
from qlora_kit.errors import RecipeError
from qlora_kit.recipe.options import Checked

console = Console()

AdapterOpt = Annotated[Path, typer.Option("--adapter", help="Folder written by qlora-kit train.")]


def register(app: typer.Typer) -> None:
    app.command()(user_errors(merge))
    app.command()(user_errors(export))


def merge(
    adapter: AdapterOpt,
    out: Annotated[Path, typer.Option("--out", help="New folder for the merged model.")],
    base: Annotated[
        str, typer.Option(help="dequantized (what the adapter trained against) or original.")
    ] = "dequantized",
    force: Annotated[bool, typer.Option(help="Export even when the drift check fails.")] = False,
    dtype: Annotated[
        str, typer.Option(help="The merged weights' dtype: float16, bfloat16 or float32 (merged in fp32).")
    ] = "float16",
    max_kl: Annotated[
        float | None,
        typer.Option(
            help="Largest mean KL(adapter || merged) accepted, at the held-out answers and at every position [default: the bounds derived for the merge from its dtype, depth and the adapter's distributions, docs: after-training.md]."
        ),
        Checked("--max-kl", bounds={"ge": 0}),
    ] = None,
    min_top1: Annotated[
        float | None,
        typer.Option(
            help="Smallest top-1 agreement where the adapter's choice is decided [default: the calibrated bound]."
        ),
        Checked("--min-top1", bounds={"ge": 0, "le": 1}),
    ] = None,
) -> None:
    """Merge the adapter into its base and export a standalone model, checked for drift."""
    configure_logging(errors)
    from qlora_kit.after.merge import merge_adapter
    from qlora_kit.errors import MergeDriftError

    if base not in ("dequantized", "original"):
        raise RecipeError(f"--base: must be dequantized or original (got {base!r})")
    try:
        bounds = {k: v for k, v in (("max_kl", max_kl), ("min_top1", min_top1)) if v is not None}
        result = merge_adapter(adapter, out, base=base, force=force, dtype=dtype, **bounds)
    except MergeDriftError as exc:
        errors.print(f"[bold red]refused:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(GUARD_STOP) from None
    drift = result.drift
    console.print(
        f"drift at {drift.positions} answer positions: mean KL {drift.mean_kl:.3g} (max {drift.max_kl:.3g}), "
        f"top-1 agreement {drift.top1_agreement:.1%} at the {drift.decided} the adapter is decided at (every "
        f"position: mean KL {drift.all_kl:.3g}, max {drift.max_all_kl:.3g}; top-1 {drift.all_top1:.1%})"
        + (
            f"; {drift.routing_ties} positions whose routing flipped at a near-tie left out"
            if drift.routing_ties
            else ""
        ),
        highlight=False,
    )
    console.print(
        f"merged model ({base} base) written to [bold]{escape(str(result.output_dir))}[/]", highlight=False
    )


def export(
    adapter: AdapterOpt,
    to: Annotated[
        str,
        typer.Option("--to", help="merged (safetensors: transformers, vLLM) or gguf (llama.cpp, Ollama)."),
    ],
    out: Annotated[
        Path | None, typer.Option("--out", help="New folder for the export (default: ADAPTER-TO).")
    ] = None,
    type_: Annotated[str, typer.Option("--type", help="GGUF tensor type: f16, bf16 or q8_0.")] = "f16",
    lora_only: Annotated[
        bool, typer.Option("--lora-only", help="GGUF: the adapter alone (llama.cpp --lora) beside its base.")
    ] = False,
    onto: Annotated[
        str,
        typer.Option(help="Merge into dequantized (what the adapter trained against) or original weights."),
    ] = "dequantized",
    prompts: Annotated[
        Path | None, typer.Option("--prompts", help='Parity prompts: JSONL, one {"prompt": ...} per line.')
    ] = None,
    check: Annotated[
        Path | None, typer.Option("--check", help="Re-run the parity report on an earlier export folder.")
    ] = None,
    dtype: Annotated[
        str,
        typer.Option(help="--to merged: the weights' dtype, float16, bfloat16 or float32 (merged in fp32)."),
    ] = "float16",
    force: Annotated[bool, typer.Option(help="Write the export even when the parity report fails.")] = False,
    # checked by after/export.py's _check_size, which the Python API shares, naming each option
    prompt_count: Annotated[
        int | None,
        typer.Option("--prompt-count", help="Parity prompts asked (default 16)."),
        Checked("--prompt-count", by="export._check_size"),
    ] = None,
    tokens: Annotated[
        int | None,
        typer.Option("--tokens", help="Greedy tokens compared per parity prompt (default 16)."),
        Checked("--tokens", by="export._check_size"),
    ] = None,
) -> None:
    """Export the run for serving and prove it behaves like the trained adapter (export_report.json)."""
    configure_logging(errors)
    from qlora_kit.after import export as exporting
    from qlora_kit.data.sources import read_prompts
    from qlora_kit.errors import ExportError, ExportParityError

    texts = read_prompts(str(prompts)) if prompts is not None else None
    # the report's size where given (export's own defaults otherwise: the CLI imports no torch to read them)
    size = {"prompt_count": prompt_count, "tokens": tokens}
    size = {name: value for name, value in size.items() if value is not None}
    try:
        if check is not None:
            report = exporting.check_export(adapter, check, prompts=texts, **size)
            folder = check
        else:
            result = exporting.export(
                adapter, to, out, type_, lora_only, onto, prompts=texts, dtype=dtype, force=force, **size
            )
            report, folder = result.report, result.output_dir
    except ExportError as exc:
        errors.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(USER_ERROR) from None
    except ExportParityError as exc:
        errors.print(f"[bold red]refused:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(GUARD_STOP) from None
    views.show_export(console, report)
    if report["failures"]:
        for line in report["failures"]:
            errors.print(f"[bold red]parity:[/] {escape(line)}", highlight=False, soft_wrap=True)
        if not force or check is not None:
            raise typer.Exit(GUARD_STOP)
    done = "checked" if check is not None else "written to"
    console.print(f"export {done} [bold]{escape(str(folder))}[/]", highlight=False)
