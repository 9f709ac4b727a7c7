"""How ``qlora-kit plan`` shows a plan: its tables (weights, LoRA, optimizer, each checkpointing policy's
activations and peak), the longest row that fits, and the same figures as a dict for ``--json``.

Kept apart from the command (cli/app.py) so it holds no rendering, and from views.py, which shows a run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table

from qlora_kit.registries import checkpointing as policy_table

GIB = 1024**3
MIB = 1024**2

if TYPE_CHECKING:
    from rich.console import Console

    from qlora_kit.memory.planner import Plan
    from qlora_kit.recipe.recipe import Recipe
    from qlora_kit.training.recipe_plan import RecipePlan


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
