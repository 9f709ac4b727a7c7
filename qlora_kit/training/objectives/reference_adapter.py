"""What DPO and KTO share: the frozen reference policy as TRL's second adapter "ref" on the same 4-bit base.

The reference policy is never a second copy of the 4-bit base. TRL copies the trained adapter
("default") into a frozen second adapter named "ref" on the same base when the trainer is built, and
computes each step's reference log-probabilities with "ref" active: with ``model.adapter`` that is the
starting adapter, without it the freshly initialised adapter (B = 0), i.e. the base itself. (GRPO's
reference is made the same way; its trainer, grpo/grpo.py, restores the policy its own way and says
what the reference is with ``describe_reference`` too.)

DPO's and KTO's trainers are one class each, made by ``reference_trainer`` here: ``GuardedTrainer`` on top
of TRL's trainer, in that order and nothing else, which takes the reference over once TRL built it
(``take_over_reference(self.model)`` at the end of its ``__init__``) and changes TRL's behaviour in the
same ways for both:

- TRL casts a quantized model's trainable parameters to bf16 after making the "ref" copy; the policy
  gets its fp32 values back from "ref" (bit-exact), as QLoRA keeps LoRA weights and the optimizer in
  fp32 (bf16 weights lose small updates to rounding).
- TRL turns checkpointing off and on around each reference forward with transformers' defaults, which
  would replace the recipe's policy (every_n) by "every layer" and add an input-gradient hook each step;
  the reference forward runs without grad, where checkpointing saves nothing, so it is left alone.
- TRL's telemetry ping at construction is not sent (each trainer's ``_send_telemetry``).
"""

from __future__ import annotations

import torch

from qlora_kit.training.step import private_hooks
from qlora_kit.training.step.trainer import GuardedTrainer

POLICY, REFERENCE = "default", "ref"  # TRL's adapter names (DPOTrainer.__init__, KTOTrainer.__init__)


def reference_trainer(library: type, module: str, tokenized: bool = False) -> type:
    """``GuardedTrainer`` on top of TRL's ``library`` trainer (``DPOTrainer``, ``KTOTrainer``), taking the
    reference over in ``__init__`` and sending no telemetry: the class ``Guarded<library>`` of ``module``
    (where the caller assigns it, so a pickled trainer is found there). ``tokenized``: the rows arrive tokenized by
    qlora_kit (DPO's pairs, data/preference.py), so TRL does not tokenize them again."""

    class Trainer(GuardedTrainer, library):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)  # TRL makes the "ref" adapter, then casts the policy to bf16
            self.policy_restored = take_over_reference(self.model)

        def _send_telemetry(self) -> None:
            pass  # TRL's usage ping at construction (private_hooks.py)

        def reference_description(self, adapter: str | None) -> str:
            return describe_reference(adapter)

    if tokenized:
        Trainer._prepare_dataset = _as_tokenized
    Trainer.__name__ = Trainer.__qualname__ = f"Guarded{library.__name__}"
    Trainer.__module__ = module
    Trainer.__doc__ = (
        f"{library.__name__} with qlora_kit's guards, accounting and checkpoint layout ({module})."
    )
    return private_hooks.checked(Trainer)


def _as_tokenized(self, dataset, processing_class, args, dataset_name):
    return dataset  # prompt_ids / chosen_ids / rejected_ids from data/preference.py


def take_over_reference(model) -> int:
    """After TRL built the "ref" adapter: the policy's fp32 values back, and the recipe's checkpointing
    left alone around the reference forward (see the module docstring). Returns the parameters restored."""
    restored = policy_back_to_fp32(model)
    # TRL's reference forward toggles checkpointing when this says True
    model.is_gradient_checkpointing = False
    return restored


def describe_reference(adapter: str | None) -> str:
    """What the frozen reference policy is (a second adapter on the same 4-bit base)."""
    if adapter is None:
        return "the base model (the reference adapter is the new adapter's start, B = 0)"
    return f"the starting adapter {adapter}, frozen as a second adapter named {REFERENCE!r} on the same 4-bit base"


def policy_back_to_fp32(model) -> int:
    """Give the trained adapter back the fp32 values TRL copied into "ref" before casting it to bf16."""
    restored = 0
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if not parameter.requires_grad or f".{POLICY}." not in name:
                continue
            reference = model.get_parameter(name.replace(f".{POLICY}.", f".{REFERENCE}."))
            if parameter.dtype != reference.dtype:
                parameter.data = reference.data.clone()
                restored += 1
    return restored
