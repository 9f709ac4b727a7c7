"""What a run saved for backward and what the planner's trace counted, op by op: the drift's finder.

When a plan and a measurement part, per-layer totals say where but not why. Here every storage autograd
saves is labelled with the op that made it (a ``TorchDispatchMode`` sees each op's outputs) and the
module that ran that op (forward hooks on every module), counted as ``accounting.SavedTensors`` counts
it (parameters left out, a shared storage once). ``measured_by_op`` counts a real forward pass on a
real model, ``traced_by_op`` the planner's trace of the same recipe and batch, and ``compare`` lines
them up, the largest difference first::

    python scripts/saved_by_op.py recipes/x.yaml --batch 2 --seq 256
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from qlora_kit.memory import fake_forward
from qlora_kit.memory.accounting import SavedTensors, _storage_key

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

Label = tuple[str, str]  # (module, op), e.g. ("model.layers.0.mlp.act_fn", "aten.silu")
UNKNOWN = "(made outside any op)"  # a saved tensor no op of the forward made: an input, a buffer's view


class SavedByOp(SavedTensors):
    """``SavedTensors`` that also labels each counted storage with the (module, op) that made it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.names = {id(m): _short(name) for name, m in model.named_modules()}
        self.stack: list[str] = [""]
        self.made: dict[int, Label] = {}  # storage -> the op that last made a new storage there
        self.labels: dict[int, Label] = {}  # counted storage -> its label

    @contextlib.contextmanager
    def counting(self):
        handles = []
        for module in self.model.modules():
            handles.append(module.register_forward_pre_hook(self._push))
            handles.append(module.register_forward_hook(self._pop, always_call=True))
        try:
            with _Labelling(self), super().counting():
                yield self
        finally:
            for handle in handles:
                handle.remove()

    def by_op(self) -> dict[Label, int]:
        """Bytes held for backward per (module, op), as the ``counting`` block ended."""
        totals: dict[Label, int] = defaultdict(int)
        for key, (nbytes, _) in self.seen.items():
            totals[self.labels.get(key, ("", UNKNOWN))] += nbytes
        return dict(totals)

    def _count(self, tensor: torch.Tensor) -> int | None:
        fresh = _storage_key(tensor) not in self.seen
        key = super()._count(tensor)
        if key is not None and fresh:
            self.labels[key] = self.made.get(key, (self.stack[-1], UNKNOWN))
        return key

    def _push(self, module, args) -> None:
        self.stack.append(self.names.get(id(module), "?"))

    def _pop(self, module, args, output) -> None:
        if len(self.stack) > 1:
            self.stack.pop()


class _Labelling(TorchDispatchMode):
    """Records, for every new storage an op writes, the op and the module running it."""

    def __init__(self, counter: SavedByOp) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_key(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                key = _storage_key(tensor)
                if key not in inputs:  # a view or an in-place op keeps its input's maker
                    self.counter.made[key] = (self.counter.stack[-1], str(func.overloadpacket))
        return out


def _short(name: str) -> str:
    # peft's wrapping is the same on both sides and says nothing: "base_model.model.model.layers.0" -> "model.layers.0"
    return name.removeprefix("base_model.model.")


def measured_by_op(model: torch.nn.Module, batch: dict[str, Any], precision: str = "no") -> dict[Label, int]:
    """What one training forward of ``model`` (a peft model, transformers' loss) saves, per (module, op);
    ``precision`` bf16: under the CPU's bfloat16 autocast, as the Trainer's bf16 runs it."""
    counter = SavedByOp(model)
    model.train()
    with counter.counting(), torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
        loss = model(**batch).loss
    loss.backward()
    return counter.by_op()


def traced_by_op(
    config,
    recipe: Recipe,
    batch: int,
    seq: int,
    padded: bool = True,
    device: str = "cpu",
    precision: str = "no",
) -> dict[Label, int]:
    """What the planner's trace of ``recipe``'s policy counts at ``batch`` x ``seq``, per (module, op),
    over every layer of ``config`` (a real run's, so the modules line up)."""
    made: list[SavedByOp] = []

    def counter(model: torch.nn.Module) -> SavedByOp:
        made.append(SavedByOp(model))
        return made[-1]

    shape = fake_forward.Shape(batch, seq, 1, device, padded)
    fake_forward.trace(config, recipe, recipe.memory.checkpointing, shape, precision, set(), counter=counter)
    return made[0].by_op()


@dataclass(frozen=True)
class Row:
    module: str
    op: str
    measured: int
    traced: int

    @property
    def difference(self) -> int:
        return self.traced - self.measured


def compare(measured: dict[Label, int], traced: dict[Label, int]) -> list[Row]:
    """Every (module, op) either side saved, the largest difference first."""
    rows = [Row(m, op, measured.get((m, op), 0), traced.get((m, op), 0)) for m, op in {*measured, *traced}]
    return sorted(rows, key=lambda row: (-abs(row.difference), row.module, row.op))


def table(rows: list[Row], limit: int = 30) -> str:
    """The rows as text, KiB: the ``limit`` largest differences, then the totals."""
    lines = [f"{'module':<48} {'op':<28} {'run KiB':>10} {'trace KiB':>10} {'trace-run':>10}"]
    for row in rows[:limit]:
        cells = (row.measured / 1024, row.traced / 1024, row.difference / 1024)
        lines.append(f"{row.module:<48} {row.op:<28} {cells[0]:>10.1f} {cells[1]:>10.1f} {cells[2]:>+10.1f}")
    run, trace = sum(r.measured for r in rows), sum(r.traced for r in rows)
    lines.append(f"{'total':<77} {run / 1024:>10.1f} {trace / 1024:>10.1f} {(trace - run) / 1024:>+10.1f}")
    return "\n".join(lines)
