"""A mixture of experts' routing during training: tokens per expert per layer, the auxiliary loss, starvation.

A router that sends no tokens to an expert leaves that expert's LoRA untrained, and nothing in the loss says
so. ``ExpertLoad`` counts, for every decoder layer, the tokens its router sends to each expert in the
training forward passes (not the ones activation checkpointing recomputes in backward, nor evaluation's),
and at each log adds to it (every position the router sees counts, padding included; a step the
out-of-memory split redoes counts the failed attempt's forward passes too):

- ``experts/aux_loss``: the model's auxiliary load-balancing loss, mean over the window's micro-batches,
  when the model config computes it (``output_router_logits``; its ``router_aux_loss_coef`` times it is in
  the loss);
- ``experts/max_load``: the busiest expert's tokens over the mean expert's, worst layer (1.0 is balanced);
- ``experts/idle``: experts that got no token in the window, over all layers;

and the per-layer counts to ``metrics.jsonl`` (``tokens_per_expert``: one list per layer). One warning when
an expert has had no token for ``IDLE_STEPS`` optimizer steps. The counts stay on the device until the log
(one host read per log, as throughput's).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import TrainerCallback

from qlora_kit.memory.accounting import decoder_layers
from qlora_kit.model import moe_experts
from qlora_kit.registries import metric_keys as keys
from qlora_kit.training.distributed import over_ranks

log = logging.getLogger("qlora_kit.training.pipeline")

IDLE_STEPS = 50  # optimizer steps without a token before the one warning


def routers(model) -> tuple[list[torch.nn.Module], int]:
    """Each decoder layer's router, in layer order, and the experts each routes to ([] and 0 for a dense
    model or one the table does not know)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    found, count = moe_experts.layer_routers(base, decoder_layers(base))
    return [router for _, router in found], count


def in_forward_pass() -> bool:
    """False inside backward, where non-reentrant checkpointing recomputes a layer's forward."""
    return torch._C._current_graph_task_id() == -1


class ExpertLoad(TrainerCallback):
    """The module docstring's counts, kept per window between two logs."""

    def __init__(self, model, metrics_log) -> None:
        self.routers, self.experts = routers(model)
        self.metrics_log = metrics_log
        self.counts: list[torch.Tensor | None] = [None] * len(self.routers)
        self.aux_sum: torch.Tensor | None = None
        self.aux_batches = 0
        self.idle_steps = torch.zeros(len(self.routers), self.experts, dtype=torch.long)
        self.window_start = 0
        self.warned = False
        for index, router in enumerate(self.routers):
            router.register_forward_hook(self._count(index))
        if self.routers:
            model.register_forward_hook(self._aux)

    def _count(self, index: int):
        def hook(module, args, output) -> None:
            if not module.training or not in_forward_pass():
                return
            picks = torch.bincount(output[-1].reshape(-1), minlength=self.experts).detach()
            self.counts[index] = picks if self.counts[index] is None else self.counts[index] + picks

        return hook

    def _aux(self, module, args, output) -> None:
        aux = getattr(output, "aux_loss", None)
        if aux is None or not module.training or not in_forward_pass():
            return
        self.aux_sum = aux.detach().float() if self.aux_sum is None else self.aux_sum + aux.detach().float()
        self.aux_batches += 1

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs) -> None:
        if not self.routers or logs is None or "loss" not in logs:
            return
        zeros = torch.zeros(self.experts, dtype=torch.long)
        counts = torch.stack([c.cpu() if c is not None else zeros for c in self.counts])
        counts = (
            over_ranks(counts.double()).cpu().long()
        )  # every rank logs at the same step (NCCL: on its GPU)
        if self.aux_sum is not None:
            logs[keys.EXPERTS + keys.AUX_LOSS] = float(self.aux_sum) / self.aux_batches
        mean = counts.float().mean(dim=1).clamp(min=1e-9)
        logs[keys.EXPERTS + keys.MAX_LOAD] = float((counts.max(dim=1).values / mean).max())
        logs[keys.EXPERTS + keys.IDLE] = int((counts == 0).sum())
        self.metrics_log.attach(keys.TOKENS_PER_EXPERT, counts.tolist())
        steps = state.global_step - self.window_start
        self.idle_steps = torch.where(counts == 0, self.idle_steps + steps, 0)
        self._warn_once(self.idle_steps)
        self.counts = [None] * len(self.routers)
        self.aux_sum, self.aux_batches, self.window_start = None, 0, state.global_step

    def _warn_once(self, idle_steps: torch.Tensor) -> None:
        starved = (idle_steps >= IDLE_STEPS).nonzero().tolist()
        if starved and not self.warned:
            self.warned = True
            named = ", ".join(f"layer {layer} expert {expert}" for layer, expert in starved[:5])
            more = f" and {len(starved) - 5} more" if len(starved) > 5 else ""
            log.warning(
                "experts without a token for %d+ optimizer steps: %s%s (the router sends them nothing, so "
                "their LoRA does not train; a larger micro-batch spreads tokens wider)",
                IDLE_STEPS,
                named,
                more,
            )
