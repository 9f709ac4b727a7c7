"""Guards that stop a run which trains nothing or trains on garbage, at the step it happens.

- The loss guard: a NaN or infinite loss stops the run before the optimizer applies it, so the last
  checkpoint written is the last good state. The Trainer itself only hides such losses from its logs
  (``logging_nan_inf_filter``).
- The gradient guard: a NaN or infinite LoRA gradient stops the run the same way, except under fp16
  with a gradient scaler, whose overflow steps (normal early in training) the scaler skips itself;
  there only a scaler that skips ``MAX_SKIPPED_STEPS`` steps in a row stops the run.
- The dead-gradient guard: every LoRA tensor must receive a non-zero gradient. peft starts B at zero,
  so while B is zero A's gradient is exactly zero in a healthy run (dL/dA = B^T ...): B is checked at
  the first optimizer step, A at the first step after its B has moved. A LoRA matrix without gradient
  is the classic silent QLoRA failure: checkpointing without input gradients.

On a GPU every ``bool(tensor)`` is a host sync that stalls the queue of kernels. So the losses of a
step's micro-batches are folded into one device flag without reading it, and the guard reads the
loss flag and the gradients' finiteness together, once per optimizer step, after DDP's all-reduce
and with the flags themselves all-reduced, so every rank stops at the same step. (The Trainer's own
per-micro-batch read, ``logging_nan_inf_filter``, is turned off in trainer.py: the guard stops
a run before such a loss could be logged.) The dead-gradient check reads each tensor once, batched.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

from qlora_kit.errors import TrainingGuardError
from qlora_kit.training.distributed import over_ranks
from qlora_kit.training.run_folder.outputs import complete_checkpoints

if TYPE_CHECKING:
    from collections.abc import Iterable

# With a scaler halving its scale at each overflow, 25 in a row take the default 2**16 below 2**-8:
# no healthy run overflows that often.
MAX_SKIPPED_STEPS = 25
WRAPPED_FSDP = "_fsdp_wrapped_module."
WRAPPED_CHECKPOINT = "_checkpoint_wrapped_module."


class TrainingGuard(TrainerCallback):
    """The loss, gradient and dead-gradient guards, read once before each optimizer step.

    ``record_loss`` is called by the Trainer subclass after each micro-batch's backward pass. Whether a
    GradScaler is active is read from the optimizer accelerate prepared (fp16 on CUDA has one; fp16
    on a CPU or under DeepSpeed has none), so non-finite gradients are its overflow steps only then.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.lora = _lora_parameters(model)
        self.unchecked = set(self.lora)
        self.skipped_in_a_row = 0
        self._loss_bad: torch.Tensor | None = None  # any non-finite micro-batch loss since the last step

    def on_train_begin(self, args, state, control, model=None, **kwargs) -> None:
        # FSDP2 (fully_shard, when accelerate prepares the model, after this guard was built) replaces
        # every parameter with a sharded one; the ones read at construction would never get a gradient.
        if model is not None:
            self.lora = _lora_parameters(model)

    def record_loss(self, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach())
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        step = state.global_step + 1
        scaler = getattr(kwargs.get("optimizer"), "scaler", None) is not None
        loss_bad, grads_bad = self._read_flags()  # the step's one host sync
        if loss_bad:
            raise TrainingGuardError(
                f"step {step}: the loss is NaN or infinite; training stopped before applying it "
                f"({kept(args.output_dir)}). Lower optimizer.lr or check the data"
            )
        if grads_bad and not scaler:
            raise TrainingGuardError(
                f"step {step}: gradients are NaN or infinite; training stopped before applying them "
                f"({kept(args.output_dir)}). Lower optimizer.lr or check the data"
            )
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if grads_bad else 0
        if self.skipped_in_a_row >= MAX_SKIPPED_STEPS:
            raise TrainingGuardError(
                f"step {step}: fp16 gradients overflowed {self.skipped_in_a_row} steps in a row, so the "
                f"gradient scaler skipped every one ({kept(args.output_dir)}). Use "
                "train.mixed_precision: bf16 on a GPU that has it, or lower optimizer.lr"
            )
        if self.unchecked and not grads_bad:  # an overflow step says nothing about dead gradients
            self._check_dead(step)

    def _read_flags(self) -> tuple[bool, bool]:
        """(any loss since the last step non-finite, the LoRA gradients non-finite), in one host sync."""
        grads = [_local(p.grad) for p in self.lora.values() if p.grad is not None]
        loss_bad, self._loss_bad = self._loss_bad, None
        flags = [loss_bad.reshape(())] if loss_bad is not None else []
        if grads:
            flags.append(~torch.isfinite(torch.nn.utils.get_total_norm(grads)))
        if not flags:
            return False, False
        read = torch.stack([f.to(flags[0].device) for f in flags]).to(torch.uint8)
        # A NaN loss on one rank is NaN gradients on all after DDP's all-reduce; under fp16 the others
        # would take that for an overflow step and wait for the stopped rank forever. Under FSDP each
        # rank holds a shard of each gradient: the flags of all shards together.
        values = over_ranks(read, dist.ReduceOp.MAX).tolist()
        return (loss_bad is not None and bool(values[0])), (bool(grads) and bool(values[-1]))

    def _check_dead(self, step: int) -> None:
        # An A matrix whose B is still all zero gets an exactly zero gradient in a healthy run: peft's
        # default init, and any step before the learning rate has left zero (warmup). Check it later.
        partner = {n: n.replace(".lora_A.", ".lora_B.") for n in self.unchecked if ".lora_A." in n}
        b_zero = all_zero({b: self.lora[b] for b in partner.values() if b in self.lora})
        due = [n for n in self.unchecked if not b_zero.get(partner.get(n, ""), False)]
        silent = all_zero({n: self.lora[n].grad for n in due})
        dead = sorted(n for n in due if silent[n])
        self.unchecked.difference_update(due)
        if dead:
            modules = sorted({_module_of(n) for n in dead})
            shown = ", ".join(modules[:4]) + (f" and {len(modules) - 4} more" if len(modules) > 4 else "")
            raise TrainingGuardError(
                f"step {step}: {len(dead)} LoRA tensors got no gradient (all zero), in "
                f"{shown}; gradients do not reach them (checkpointing without input gradients is the usual cause)"
            )


def all_zero(tensors: dict[str, torch.Tensor | None]) -> dict[str, bool]:
    """Name -> whether the tensor is missing or all zero, read in one host sync."""
    present = {n: t for n, t in tensors.items() if t is not None}
    result = dict.fromkeys(tensors, True)
    if present:
        nonzero = _stack_any(present.values())
        result.update({n: not v for n, v in zip(present, nonzero, strict=True)})
    return result


def _stack_any(tensors: Iterable[torch.Tensor]) -> list[bool]:
    """Whether each tensor has a non-zero element; of a sharded (FSDP) tensor, in any rank's shard."""
    flags = [_local(t).detach().ne(0).any() for t in tensors]
    read = torch.stack([f.to(flags[0].device) for f in flags]).to(torch.uint8)
    return [bool(v) for v in over_ranks(read, dist.ReduceOp.MAX).tolist()]


def _lora_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    # Names as peft gives them: wrappers that insert a module level (FSDP1, torch's checkpoint_wrapper)
    # would otherwise rename them between construction and training.
    return {
        name.replace(WRAPPED_FSDP, "").replace(WRAPPED_CHECKPOINT, ""): p
        for name, p in model.named_parameters()
        if p.requires_grad and ".lora_" in name
    }


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 (DTensor) tensor; any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _module_of(parameter_name: str) -> str:
    # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight -> model.layers.0.self_attn.q_proj
    module = parameter_name.split(".lora_")[0]
    return module.removeprefix("base_model.model.")


def kept(output_dir: str) -> str:
    """What survives a stop: the newest checkpoint (looked up only when stopping: it scans a folder)."""
    # the newest *complete* one, as --resume means it (run_folder/outputs.py): a half-written folder is not kept
    complete = complete_checkpoints(Path(output_dir)) if output_dir else []
    return f"the last checkpoint, {complete[-1]}, is intact" if complete else "no checkpoint was written"
