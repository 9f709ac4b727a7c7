"""Test-only observers of a real run: what the training forward actually ran under, and what it dispatched.

A recipe's ``train.mixed_precision`` passes through ``resolve_mixed_precision``, ``TrainingArguments`` and
accelerate before it becomes an autocast around the forward pass; a test that only reads the recipe
back would stay green if any of those links dropped it. ``AutocastProbe`` looks at the far end.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import TrainerCallback

# what accelerate's autocast looks like from inside the forward, per resolved precision
EXPECTED_AUTOCAST = {"no": {(False, None)}, "bf16": {(True, torch.bfloat16)}, "fp16": {(True, torch.float16)}}


class AutocastProbe(TrainerCallback):
    """Records, for every training forward of the model, whether autocast was on and in which dtype.

    ``seen``: a set of ``(enabled, dtype)``, dtype None when autocast was off. Attach it with
    ``train(recipe, callbacks=[probe])`` or ``trainer.add_callback(probe)``."""

    def __init__(self) -> None:
        self.seen: set[tuple[bool, torch.dtype | None]] = set()
        self._handle = None

    def _record(self, module, args, kwargs) -> None:
        if not module.training:  # evaluation and sample generation are not the training forward
            return
        device = next(module.parameters()).device.type
        enabled = torch.is_autocast_enabled(device)
        self.seen.add((enabled, torch.get_autocast_dtype(device) if enabled else None))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # the innermost causal LM: it runs inside whatever wrappers accelerate put around the PeftModel
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        self._handle = inner.register_forward_pre_hook(self._record, with_kwargs=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


# Operators that only allocate: on CUDA the caching allocator hands out memory without a launch, and torch
# releases differ in where they allocate (2.7's loss dispatches an aten.empty per chunk that 2.13's does not)
ALLOCATIONS = frozenset({"aten.empty", "aten.empty_strided"})


class OperatorCount(TorchDispatchMode):
    """How many operators dispatch while the mode is on, by name: on a GPU each is a launch at least, so the
    count is the launch cost the CPU can see. Views (metadata only) and bare allocations launch nothing and
    are left out; a fill or a copy after an allocation is counted."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if not func.is_view and name not in ALLOCATIONS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))
