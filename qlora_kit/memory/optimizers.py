"""The optimizer registry: one ``OptimizerSpec`` per ``optimizer.name``, read by everything else.

The recipe's choices, the Trainer setup (``optimizer_class_and_kwargs``), the state report a run logs
(``optimizer_state_report``), the output folder's free-space check and the planner all read a spec,
so adding an optimizer is one entry here (plus its tests). The class is named by import path and
imported only when a run builds it: the recipe reads this module, and ``qlora-kit --help`` stays fast.

Paged optimizers keep their state in CUDA unified memory that the driver evicts to host RAM under
pressure; bitsandbytes pages only the state of parameters with at least ``PAGEABLE_MIN_ELEMENTS``
elements (``Optimizer8bit.get_state_buffer``), and on a CPU nothing (it falls back to ordinary tensors).
"""

from __future__ import annotations

import importlib
import logging
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from qlora_kit.recipe import OptimizerSection

log = logging.getLogger(__name__)

PAGEABLE_MIN_ELEMENTS = 100_000  # bitsandbytes.optim.optimizer.Optimizer8bit.get_state_buffer
# bitsandbytes' 8-bit optimizers keep 32-bit state for tensors smaller than this (min_8bit_size)
MIN_8BIT_ELEMENTS = 4096
ADAMW_DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8}


@dataclass(frozen=True)
class OptimizerSpec:
    """What the rest of qlora_kit needs to know about one optimizer."""

    name: str
    class_path: str  # "module:Class", imported when a run builds the optimizer
    paged: bool  # state in CUDA unified memory (bitsandbytes' paged optimizers)
    eight_bit: bool  # 8-bit blockwise state (bitsandbytes), else 32-bit
    moments: int = 2  # state tensors per parameter (AdamW: first and second moment)
    # steps FSDP2's sharded (DTensor) parameters; bitsandbytes' update kernels are custom ops with no
    # DTensor sharding rule ("Operator bitsandbytes.optimizer_update_32bit.default does not have a
    # sharding strategy registered", bitsandbytes 0.50.2 + torch 2.13, tests/e2e/test_fsdp.py)
    shards: bool = False
    kwargs: dict[str, Any] = field(default_factory=lambda: dict(ADAMW_DEFAULTS))  # besides lr

    def state_bytes(self, elements: int) -> int:
        """State for one parameter: fp32 moments, or uint8 moments plus one fp32 absmax per 256-element
        block and a 256-entry fp32 quantization map each; small tensors keep 32-bit state."""
        if self.eight_bit and elements >= MIN_8BIT_ELEMENTS:
            return self.moments * (elements + 4 * -(-elements // 256) + 256 * 4)
        return self.moments * 4 * elements

    def pageable(self, elements: int) -> bool:
        return self.paged and elements >= PAGEABLE_MIN_ELEMENTS

    def load_class(self) -> type:
        module, _, name = self.class_path.partition(":")
        return getattr(importlib.import_module(module), name)


OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec("paged_adamw_8bit", "bitsandbytes.optim:PagedAdamW8bit", paged=True, eight_bit=True),
        OptimizerSpec("paged_adamw_32bit", "bitsandbytes.optim:PagedAdamW32bit", paged=True, eight_bit=False),
        OptimizerSpec("adamw_8bit", "bitsandbytes.optim:AdamW8bit", paged=False, eight_bit=True),
        OptimizerSpec("adamw_torch", "torch.optim:AdamW", paged=False, eight_bit=False, shards=True),
    )
}


def optimizer_class_and_kwargs(optimizer: OptimizerSection) -> tuple[type, dict[str, Any]]:
    """The optimizer class and its constructor arguments, for the Trainer's ``optimizer_cls_and_kwargs``.

    The Trainer passes these kwargs as they are (its own learning_rate is not added), so lr is here;
    weight decay it applies per parameter group.
    """
    import torch

    spec = OPTIMIZERS[optimizer.name]
    if spec.paged and not torch.cuda.is_available():
        log.info(
            "optimizer %s: no CUDA device, so its state is ordinary host memory (nothing to page)",
            optimizer.name,
        )
        # bitsandbytes warns once per state tensor otherwise; the line above says it once.
        warnings.filterwarnings("ignore", message="Paged optimizers are not supported on CPU")
    return spec.load_class(), {"lr": optimizer.lr, **spec.kwargs}


@dataclass
class OptimizerStateReport:
    pageable_bytes: int
    resident_bytes: int
    pageable_tensors: int
    parameters: int

    @property
    def total_bytes(self) -> int:
        return self.pageable_bytes + self.resident_bytes


def optimizer_state_report(params: list[torch.nn.Parameter], name: str) -> OptimizerStateReport:
    """State bytes the optimizer will hold, split into what bitsandbytes pages and what stays resident."""
    spec = OPTIMIZERS[name]
    pageable = resident = tensors = 0
    for param in params:
        nbytes = spec.state_bytes(param.numel())
        if spec.pageable(param.numel()):
            pageable += nbytes
            tensors += 1
        else:
            resident += nbytes
    return OptimizerStateReport(pageable, resident, tensors, len(params))


def repage_optimizer_state(optimizer) -> int:
    """Move a resumed paged optimizer's state back into paged (unified) memory; returns how many tensors.

    The Trainer loads optimizer.pt onto the CPU and bitsandbytes' ``load_state_dict`` moves each state
    tensor to its parameter's device as an ordinary CUDA tensor (``Optimizer8bit.load_state_dict``), so
    after ``--resume`` a paged optimizer would page nothing. Each such tensor is copied into a buffer
    from the optimizer's own ``get_state_buffer``, which pages exactly what a fresh run pages (CUDA
    parameters of >= 100,000 elements); on a CPU nothing is paged and nothing changes.
    """
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
    if not getattr(inner, "is_paged", False):
        return 0
    moved = 0
    for group in inner.param_groups:
        for param in group["params"]:
            state = inner.state.get(param, {})
            for key in ("state1", "state2"):
                value = state.get(key)
                if value is None or getattr(value, "is_paged", False) or value.shape != param.shape:
                    continue
                buffer = inner.get_state_buffer(param, dtype=value.dtype)
                if getattr(buffer, "is_paged", False):
                    buffer.copy_(value)
                    state[key] = buffer
                    moved += 1
    if moved:
        torch.cuda.empty_cache()  # the ordinary copies just replaced
    return moved
