"""Guards that stop a run which trains nothing or trains on garbage, at the step it happens.

- The gradient guard: every LoRA tensor must receive a finite, non-zero gradient. peft starts B at
  zero, so while B is zero A's gradient is exactly zero in a healthy run (dL/dA = B^T ...): B is
  checked at the first optimizer step, A at the first step after its B has moved. A LoRA matrix
  without gradient is the classic silent QLoRA failure: checkpointing without input gradients.
- The loss guard: a NaN or infinite loss stops the run before the optimizer applies it, so the last
  checkpoint written is the last good state. The Trainer itself only hides such losses from its logs
  (``logging_nan_inf_filter``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from transformers import TrainerCallback

if TYPE_CHECKING:
    import torch


class TrainingGuardError(RuntimeError):
    """A run stopped by a guard: one line saying what happened, where, and what is kept."""


class GradientGuard(TrainerCallback):
    """Checks each LoRA tensor's gradient before an optimizer step, once it is expected to have one."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.lora = {name: p for name, p in model.named_parameters() if p.requires_grad and ".lora_" in name}
        self.unchecked = set(self.lora)

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        step = state.global_step + 1
        self._check_finite(step, args.output_dir)
        if not self.unchecked:
            return
        # An A matrix whose B is still all zero gets an exactly zero gradient in a healthy run: peft's
        # default init, and any step before the learning rate has left zero (warmup). Check it later.
        due = [n for n in self.unchecked if not (".lora_A." in n and self._b_is_zero(n))]
        dead = sorted(n for n in due if not _has_signal(self.lora[n].grad))
        self.unchecked.difference_update(due)
        if dead:
            modules = sorted({_module_of(n) for n in dead})
            shown = ", ".join(modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
            raise TrainingGuardError(
                f"step {step}: {len(dead)} LoRA tensors got no gradient (all zero), in "
                f"{shown}; gradients do not reach them (checkpointing without input gradients is the usual cause)"
            )

    def _check_finite(self, step: int, output_dir: str) -> None:
        """Every step: a NaN or infinite gradient stops the run before the optimizer applies it."""
        import torch
        from transformers.trainer_utils import get_last_checkpoint

        grads = [p.grad for p in self.lora.values() if p.grad is not None]
        if grads and not torch.isfinite(torch.nn.utils.get_total_norm(grads)):
            raise TrainingGuardError(
                f"step {step}: gradients are NaN or infinite; training stopped before applying them "
                f"({_kept(get_last_checkpoint(output_dir))}). Lower optimizer.lr or check the data"
            )

    def _b_is_zero(self, a_name: str) -> bool:
        b = self.lora.get(a_name.replace(".lora_A.", ".lora_B."))
        return b is not None and not bool(b.detach().any())


def _has_signal(grad: torch.Tensor | None) -> bool:
    if grad is None:
        return False
    import torch

    return bool(torch.isfinite(grad).all()) and bool(grad.abs().sum() > 0)


def _module_of(parameter_name: str) -> str:
    # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight -> model.layers.0.self_attn.q_proj
    module = parameter_name.split(".lora_")[0]
    return module.removeprefix("base_model.model.")


def check_loss(loss: torch.Tensor, step: int, last_checkpoint: str | None) -> None:
    """Raise when the loss of ``step`` is NaN or infinite."""
    value = float(loss.detach())
    if not math.isfinite(value):
        raise TrainingGuardError(
            f"step {step}: the loss is {value}; training stopped before applying it "
            f"({_kept(last_checkpoint)}). Lower optimizer.lr or check the data"
        )


def _kept(last_checkpoint: str | None) -> str:
    return (
        f"the last checkpoint, {last_checkpoint}, is intact"
        if last_checkpoint
        else "no checkpoint was written"
    )
