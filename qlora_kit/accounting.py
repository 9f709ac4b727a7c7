"""Memory accounting during training: what autograd keeps for backward, peaks per phase on CUDA, and
how much optimizer state a paged optimizer can actually page.

- ``SavedTensors`` counts the bytes autograd saves for backward during a forward pass, through
  ``torch.autograd.graph.saved_tensors_hooks``: parameters are excluded, a storage shared by several
  saved tensors counts once, and each byte is attributed to the decoder layer that saved it (or to
  the embedding/head outside the layers). With checkpointing, a checkpointed layer saves only its
  inputs (torch's non-reentrant checkpoint keeps them through a no-op autograd function), so this is
  the honest measure of what checkpointing saves, on any device.
- On CUDA, ``PhasePeaks`` records ``torch.cuda.max_memory_allocated`` for forward, backward (with the
  recompute) and the optimizer step, resetting the peak between phases, plus the device's used memory
  from ``torch.cuda.mem_get_info``: paged optimizer state lives in CUDA managed memory, which the
  caching allocator does not count.
- ``optimizer_state_report`` splits the optimizer's state bytes into pageable and resident:
  bitsandbytes pages only state tensors of parameters with at least 100,000 elements
  (``Optimizer8bit.get_state_buffer``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PAGEABLE_MIN_ELEMENTS = 100_000  # bitsandbytes.optim.optimizer.Optimizer8bit.get_state_buffer
OUTSIDE = "outside layers"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


@dataclass
class SavedBytes:
    total: int = 0
    per_layer: dict[str, int] = field(default_factory=dict)

    def layer(self, index: int) -> int:
        return self.per_layer.get(f"layer {index}", 0)


class SavedTensors:
    """Counts bytes saved for backward while active; use one instance per forward pass."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
        self.seen: dict[int, tuple[int, str]] = {}
        self.where = OUTSIDE

    @contextlib.contextmanager
    def counting(self):
        import torch

        handles = []
        for index, layer in enumerate(decoder_layers(self.model)):
            handles.append(layer.register_forward_pre_hook(self._enter(f"layer {index}")))
            handles.append(layer.register_forward_hook(self._leave))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda saved: saved):
                yield self
        finally:
            for handle in handles:
                handle.remove()

    def result(self) -> SavedBytes:
        per_layer: dict[str, int] = defaultdict(int)
        for nbytes, where in self.seen.values():
            per_layer[where] += nbytes
        return SavedBytes(total=sum(per_layer.values()), per_layer=dict(per_layer))

    def _enter(self, name: str):
        def hook(module, args):
            self.where = name

        return hook

    def _leave(self, module, args, output) -> None:
        self.where = OUTSIDE

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.excluded and pointer not in self.seen:
            self.seen[pointer] = (storage.nbytes(), self.where)
        return tensor


def measure_saved_bytes(
    model: torch.nn.Module, batch: dict[str, Any], chunk_tokens: int | None = None
) -> SavedBytes:
    """Bytes saved for backward by one training forward pass of ``model`` (a peft model) on ``batch``,
    with transformers' loss, or with the chunked loss head when ``chunk_tokens`` is given."""
    from qlora_kit.loss_head import chunked_lm_loss

    counter = SavedTensors(model)
    model.train()
    with counter.counting():
        loss = model(**batch).loss if chunk_tokens is None else chunked_lm_loss(model, batch, chunk_tokens)
    loss.backward()
    return counter.result()


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
    from qlora_kit.memory import OPTIMIZERS

    class_name, paged = OPTIMIZERS[name]
    eight_bit = class_name is not None and "8bit" in class_name
    pageable = resident = tensors = 0
    for param in params:
        nbytes = state_bytes(param.numel(), eight_bit)
        if paged and param.numel() >= PAGEABLE_MIN_ELEMENTS:
            pageable += nbytes
            tensors += 1
        else:
            resident += nbytes
    return OptimizerStateReport(pageable, resident, tensors, len(params))


def state_bytes(elements: int, eight_bit: bool) -> int:
    """AdamW state for one parameter: two fp32 moments, or two uint8 moments plus one fp32 absmax per
    256-element block and the two 256-entry fp32 quantization maps; tensors under 4,096 elements keep
    32-bit state even in 8-bit optimizers."""
    if eight_bit and elements >= 4096:
        return 2 * elements + 2 * 4 * -(-elements // 256) + 2 * 256 * 4
    return 8 * elements


@dataclass
class PhasePeaks:
    """Peak allocated CUDA memory per phase of a step, and the device's used memory."""

    forward: int = 0
    backward: int = 0
    optimizer: int = 0
    device_used: int = 0

    def as_dict(self) -> dict[str, float]:
        gib = 1024**3
        return {
            "peak_forward_gib": self.forward / gib,
            "peak_backward_gib": self.backward / gib,
            "peak_optimizer_gib": self.optimizer / gib,
            "device_used_gib": self.device_used / gib,
        }
