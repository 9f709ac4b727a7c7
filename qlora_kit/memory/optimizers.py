"""Memory stage: building the recipe's optimizer, the state it will hold, and paging it back after a resume.

Which optimizers exist and what each keeps is the registry's (``registries/optimizers.py``); this module
is the part that needs torch: the class and arguments the Trainer builds, the state report a run logs, and
re-paging a resumed paged optimizer's state.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qlora_kit.registries.optimizers import OPTIMIZERS

if TYPE_CHECKING:
    import torch

    from qlora_kit.recipe.recipe import OptimizerSection

log = logging.getLogger(__name__)


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
