"""What a run tells its user about itself: the setup before training and the memory after it.

Called by the main process only (pipeline.run); every line goes to the ``qlora_kit`` logger.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from qlora_kit.data.prepare import PreparedData, pad_shares
from qlora_kit.memory.optimizers import optimizer_state_report
from qlora_kit.model import moe_experts
from qlora_kit.model.adapters import trainable_parameter_count
from qlora_kit.registries import checkpointing as table
from qlora_kit.registries import metric_keys as keys
from qlora_kit.registries.optimizers import OPTIMIZERS, PAGEABLE_MIN_ELEMENTS

if TYPE_CHECKING:
    from qlora_kit.recipe.data import DataSection
    from qlora_kit.recipe.recipe import Recipe, TrainSection

log = logging.getLogger("qlora_kit.training.pipeline")


def log_setup(
    peft_model, checkpointed: list[int], prepared: PreparedData, data: DataSection, train: TrainSection
) -> None:
    """The adapter's size, the checkpointed layers, each data source's report and the batches' padding
    (``data``, ``train``: the resolved recipe's sections)."""
    trainable, total = trainable_parameter_count(peft_model)
    log.info(
        "trainable parameters: %s of %s (%.2f%%)", f"{trainable:,}", f"{total:,}", 100 * trainable / total
    )
    if moe_experts.fused_experts(peft_model):  # a mixture of experts: where the adapter sits, by kind
        counts = moe_experts.trainable_by_kind(peft_model)
        log.info("trainable parameters by kind: %s", ", ".join(f"{k} {v:,}" for k, v in counts.items()))
        config = peft_model.get_base_model().config  # transformers adds the aux loss when the config says so
        aux = (
            f"on, x{config.router_aux_loss_coef:g}"
            if getattr(config, "output_router_logits", False)
            else "off"
        )
        log.info("router: frozen; auxiliary load-balancing loss (the model config's): %s", aux)
    log.info("checkpointed decoder layers: %s", checkpointed or "none")
    for report in prepared.reports:
        log.info("data %s", report.summary())
    shares = pad_shares(prepared, data, train.micro_batch_size, train.seed)
    mode = "packing" if data.packs else "group_by_length" if data.group_by_length else "padding"
    log.info(
        "data: %d training examples in %d rows; pad tokens per batch: %.1f%% with %s (%.1f%% if padded)",
        len(prepared.example_lengths),
        len(prepared.train),
        100 * shares[mode],
        mode,
        100 * shares["padding"],
    )


def log_grpo_peaks(recipe: Recipe, device: str) -> None:
    """train.objective grpo: the planner's two peaks, rollouts and policy step, and which sets the step's."""
    from qlora_kit.memory import planner

    try:  # the line is advice: a recipe the planner cannot plan still trains
        the_plan = planner.plan(recipe, device=device)
        own = not table.planned(recipe.memory.checkpointing)
        row = the_plan.chosen(recipe) if own else min(the_plan.policies, key=lambda r: r.peak)
    except Exception as error:
        log.debug("no GRPO peaks: %s", error)
        return
    log.info("memory: %s", the_plan.grpo_peaks(row))


def log_optimizer_state(peft_model, optimizer_name: str) -> None:
    """How much state optimizer.name keeps, how much of it a paged optimizer can page; warn when it is
    asked to page nothing."""
    params = [p for p in peft_model.parameters() if p.requires_grad]
    report = optimizer_state_report(params, optimizer_name)
    log.info(
        "optimizer state: %.2f MiB, of which %.2f MiB pageable (%d of %d tensors have >= %s elements)",
        report.total_bytes / 2**20,
        report.pageable_bytes / 2**20,
        report.pageable_tensors,
        report.parameters,
        f"{PAGEABLE_MIN_ELEMENTS:,}",
    )
    spec = OPTIMIZERS[optimizer_name]
    if spec.paged and report.pageable_bytes == 0:
        unpaged = [s.name for s in OPTIMIZERS.values() if not s.paged and s.eight_bit == spec.eight_bit]
        log.warning(
            "optimizer.name %s pages nothing here: bitsandbytes pages only tensors of >= %s elements and the "
            "largest LoRA tensor has %s (raise lora.rank, or use %s)",
            optimizer_name,
            f"{PAGEABLE_MIN_ELEMENTS:,}",
            f"{max(p.numel() for p in params):,}",
            unpaged[0] if unpaged else "an optimizer that is not paged",
        )


def log_memory(usage: dict[str, Any]) -> None:
    if keys.SAVED_MIB not in usage:
        return  # no training step ran
    layers = usage[keys.SAVED_MIB_LAYERS]
    log.info(
        "memory: at most %.1f MiB saved for backward (head %.1f MiB; decoder layers %.1f-%.1f MiB each)",
        usage[keys.SAVED_MIB],
        usage[keys.SAVED_MIB_HEAD],
        min(layers, default=0.0),
        max(layers, default=0.0),
    )
    if keys.PEAK_BACKWARD in usage:
        log.info(
            "CUDA peaks: forward %.2f GiB, backward %.2f GiB, optimizer step %.2f GiB; device used %.2f GiB",
            *(usage[key] for key in keys.PEAK_KEYS),
            usage[keys.DEVICE_USED],
        )
