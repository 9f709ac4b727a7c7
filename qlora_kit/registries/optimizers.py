"""The optimizer registry: one ``OptimizerSpec`` per ``optimizer.name``, read by everything else.

The recipe's choices, the Trainer setup (``memory/optimizers.optimizer_class_and_kwargs``), the state
report a run logs, the output folder's free-space check and the planner all read a spec, so adding an
optimizer is one entry here (plus its tests). The class is named by import path and imported only when a
run builds it: the recipe reads this module, and ``qlora-kit --help`` stays fast (standard library only).

Paged optimizers keep their state in CUDA unified memory that the driver evicts to host RAM under
pressure; bitsandbytes pages only the state of parameters with at least ``PAGEABLE_MIN_ELEMENTS``
elements (``Optimizer8bit.get_state_buffer``), and on a CPU nothing (it falls back to ordinary tensors).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

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
