"""How the CLI shows results: rich tables and lines for a run, the data view, the plan and an evaluation.

Kept apart from cli.py so the command functions stay one screen each and hold no rendering.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from qlora_kit.registries import checkpointing as policy_table
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

GIB = 1024**3
MIB = 1024**2

if TYPE_CHECKING:
    from rich.console import Console

    from qlora_kit.cli.doctor import Check
    from qlora_kit.data.report import DataView
    from qlora_kit.memory.planner import Plan
    from qlora_kit.recipe.recipe import Recipe
    from qlora_kit.training.pipeline import TrainResult
    from qlora_kit.training.recipe_plan import RecipePlan
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


def show_plan(console: Console, planned: RecipePlan, budget_gb: float | None) -> None:
    """``qlora-kit plan``: the plan's tables, then the loss head it planned and why."""
    show_plan_tables(console, planned.plan, planned.recipe, budget_gb)
    console.print(planned.batch, highlight=False, markup=False)
    if planned.head is not None:
        console.print(f"loss head: {planned.head.describe()}", highlight=False, markup=False)


def show_plan_tables(console: Console, plan: Plan, recipe: Recipe, budget_gb: float | None) -> None:
    shape, weights = plan.shape, plan.weights
    table = Table(
        title=f"{recipe.model.path}: {shape.layers} layers, hidden {shape.hidden}, vocab {shape.vocab}"
    )
    for column, justify in (("memory", "left"), ("size", "right"), ("from", "left")):
        table.add_column(column, justify=justify)
    bits = 8 * weights.quantized / shape.quantized_values
    values = f"{shape.quantized_values / 1e9:.2f} B values, {bits:.2f} bits each"
    table.add_row(f"{recipe.quant.bits}-bit weights ({values})", size(weights.quantized), "closed form")
    if shape.expert_stacks:  # a mixture of experts: all of them are held, a token runs through a few
        bits = 8 * weights.experts / shape.expert_values
        active = shape.active_expert_values / shape.expert_values
        what = (
            f"{shape.expert_values / 1e9:.2f} B values, {bits:.2f} bits each; {active:.0%} active per token"
        )
        table.add_row(f"experts ({what})", size(weights.experts), "closed form")
    if plan.experts_on_host:  # memory.experts_on_host: the split between host and device, and the traffic
        table.add_row("  of them in pinned host memory (memory.experts_on_host)", size(plan.host_experts), "")
        table.add_row("  of them on the device: two layers' in flight", size(plan.experts_in_flight), "")
        copied = f"forward and backward x grad_accum {recipe.train.grad_accum}"
        table.add_row(f"  copied to the device per step ({copied})", size(plan.experts_copied_per_step), "")
        table.add_row(
            "  loading: the rest of the model and one layer's experts", size(plan.load_peak), "closed form"
        )
    table.add_row(f"unquantized layers in {recipe.quant.compute_dtype}", size(weights.unquantized), "shapes")
    table.add_row(f"LoRA parameters ({weights.lora_values / 1e6:.1f} M, fp32)", size(weights.lora), "shapes")
    table.add_row("LoRA gradients (during backward)", size(plan.lora_grads), "shapes")
    pageable = f"{size(plan.optimizer_pageable)} pageable"
    table.add_row(f"{recipe.optimizer.name} state ({pageable})", size(plan.optimizer_state), "closed form")
    if plan.shards > 1:
        table.add_row(
            f"per GPU of {plan.shards} (FSDP): 1/{plan.shards} of the above, the root and 2 layers whole",
            size(plan.static),
            "closed form",
        )
        table.add_row("per GPU while loading (the whole 4-bit model)", size(plan.load_peak), "closed form")
    layers_from = "traced" if plan.activation_source == "traced" else "Llama-shaped formula"
    if plan.rollout:  # train.objective grpo: sampling, when nothing is kept for backward
        table.add_row(
            "GRPO rollouts: KV cache and logits of a generation batch", size(plan.rollout), "closed form"
        )
    if plan.pixels:  # a vision-language model: its batch's images
        table.add_row(
            "image pixels of a batch (float32, and the tower's copy)", size(plan.pixels), "closed form"
        )
    table.add_row("activations of the decoder layers (per policy, below)", "", layers_from)
    table.add_row("activations of the loss head (in the policies' figures)", "", plan.head_source)
    console.print(table)
    if plan.activation_source == "traced":
        how = f"traced from the model's code under {plan.precision} autocast"
        attention_kernels = "; ".join(plan.kernels) or "none run"
        console.print(f"attention kernels assumed ({plan.device}): {attention_kernels}", highlight=False)
    else:
        how = "from the Llama-shaped formula (this model's code could not be traced)"
    policies = Table(title=f"per policy, at {plan.batch} x {plan.seq} tokens; activations {how}")
    columns = (
        "policy",
        "recomputed layers",
        "recompute (full layers)",
        "activations kept",
        "largest transient",
        "peak",
    )
    for column in columns:
        policies.add_column(column, justify="right")
    if budget_gb is not None:
        policies.add_column(f"fits {budget_gb:g} GiB", justify="center")
    for row in plan.policies:
        sizes = [size(nbytes) for nbytes in (row.activations, row.spike, row.peak)]
        fits = [("yes" if row.peak <= budget_gb * GIB else "no")] if budget_gb is not None else []
        policies.add_row(row.policy, str(row.recompute_layers), f"{row.recompute_cost:.2f}", *sizes, *fits)
    console.print(policies)
    console.print(
        "largest transient: the loss head's logits or backward's recompute spike (closed form); "
        "the CUDA context and allocator fragmentation come on top",
        highlight=False,
    )
    if plan.experts_on_host and not policy_table.planned(recipe.memory.checkpointing):
        row = plan.chosen(recipe)
        training = plan.training_peak(row.activations, row.spike)
        sets = "loading sets the peak" if plan.load_peak > training else "training sets the peak"
        console.print(
            f"experts on host: the training peak under {row.policy} is {size(training)}, loading needs "
            f"{size(plan.load_peak)} ({sets})",
            highlight=False,
        )
    if budget_gb is not None:
        console.print(f"auto would pick {_auto_choice(plan, recipe, budget_gb)[1]}", highlight=False)
    if plan.rollout:  # train.objective grpo: which of its two peaks sets the step's
        own = not policy_table.planned(recipe.memory.checkpointing)
        row = plan.chosen(recipe) if own else min(plan.policies, key=lambda r: r.peak)
        console.print(plan.grpo_peaks(row), highlight=False)


def show_longest_fits(console: Console, fits: list, recipe: Recipe, budget_gb: float) -> None:
    table = Table(title=f"{recipe.model.path}: the longest row that fits {budget_gb:g} GiB, micro-batch 1")
    for column in ("memory", "tokens", "device peak", "host (offloaded)", "activations kept"):
        table.add_column(column, justify="left" if column == "memory" else "right")
    for fit in fits:
        tokens = f"{fit.seq:,}" if fit.seq else "none fits"
        table.add_row(
            fit.way, tokens, size(fit.device_peak), size(fit.host) if fit.host else "-", size(fit.activations)
        )
    console.print(table)
    console.print("traced at each length shown (sdpa, one unpacked row); tiles: memory.mlp_tiles auto")


def plan_as_dict(planned: RecipePlan, budget_gb: float | None) -> dict[str, Any]:
    """The plan for scripts (``qlora-kit plan --json``): every size in bytes, and the loss head planned."""
    result = plan_tables_as_dict(planned.plan, planned.recipe, budget_gb)
    result["padded"], result["batch_layout"] = planned.plan.padded, planned.batch
    if planned.head is not None:
        head = planned.head
        result["loss_head"] = {"chunked": head.chunked, "chunk_tokens": head.chunk_tokens, "why": head.why}
    return result


def plan_tables_as_dict(plan: Plan, recipe: Recipe, budget_gb: float | None) -> dict[str, Any]:
    shape, weights = plan.shape, plan.weights
    result: dict[str, Any] = {
        "model": recipe.model.path,
        "layers": shape.layers,
        "hidden": shape.hidden,
        "vocab": shape.vocab,
        "batch": plan.batch,
        "seq": plan.seq,
        "precision": plan.precision,
        "activations_from": plan.activation_source,
        "loss_head_from": plan.head_source,
        "attention_kernels": list(plan.kernels),
        "weights_quantized": weights.quantized,
        "weights_unquantized": weights.unquantized,
        "weights_experts": weights.experts,
        "lora_parameters": weights.lora,
        "lora_gradients": plan.lora_grads,
        "optimizer_state": plan.optimizer_state,
        "optimizer_pageable": plan.optimizer_pageable,
        "fsdp_processes": plan.shards,
        "experts_on_host": plan.experts_on_host,
        "experts_host": plan.host_experts,
        "experts_in_flight": plan.experts_in_flight,
        "experts_copied_per_step": plan.experts_copied_per_step,
        "static_per_gpu": plan.static,
        "load_peak_per_gpu": plan.load_peak,
        "rollout": plan.rollout,
        "pixels": plan.pixels,
        "policies": [
            {
                "policy": row.policy,
                "recomputed_layers": row.recompute_layers,
                "recompute_cost": row.recompute_cost,  # in full layers' recomputes
                "activations": row.activations,
                "largest_transient": row.spike,
                "peak": row.peak,
                **({"fits": row.peak <= budget_gb * GIB} if budget_gb is not None else {}),
            }
            for row in plan.policies
        ],
    }
    if budget_gb is not None:
        result["budget_gib"] = budget_gb
        result["auto"], _, result["auto_layers"] = _auto_choice(plan, recipe, budget_gb)
    return result


def _auto_choice(plan: Plan, recipe: Recipe, budget_gb: float) -> tuple[str, str, list[str]]:
    """auto's choice: (its name, the name and why, each layer's policy)."""
    from qlora_kit.memory.auto import choose_layers  # the CLI boundary: torch loads only here

    row, why = choose_layers(recipe, budget_gb, plan)
    return row.policy, f"{row.policy}: {why}", row.layers


def size(nbytes: int) -> str:
    """MiB below a GiB (a tiny model's figures are not all rounding steps), GiB above."""
    if nbytes < GIB:
        return f"{nbytes / MIB:.1f} MiB"
    return f"{nbytes / GIB:.2f} GiB"


def show_eval(console: Console, results: dict[str, Any], subject: str) -> None:
    table = Table(title=f"evaluation of {escape(subject)}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    keys = ("loss", "perplexity", "exact_match", "tokens", "exact_match_examples")
    keys += ("preference_accuracy", "reward_margin", "likelihood_accuracy", "pairs", "reference")
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
