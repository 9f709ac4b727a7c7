"""Memory accounting during training: what autograd keeps for backward, and peaks per phase on CUDA.

- ``SavedTensors`` counts the bytes autograd saves for backward during a forward pass, through
  ``torch.autograd.graph.saved_tensors_hooks``: parameters are excluded, a storage shared by several
  saved tensors counts once, and each byte is attributed to the decoder layer that saved it (or to
  the embedding/head outside the layers). With checkpointing, a checkpointed layer saves only its
  inputs (torch's non-reentrant checkpoint keeps them through a no-op autograd function), so this is
  the honest measure of what checkpointing saves, on any device. Selective checkpointing keeps some
  ops' outputs in torch's own cache rather than through those hooks; its policy reports each one to
  ``note_saved``, which counts it the same way. Offloaded checkpoints (``offload.py``) move a checkpointed
  layer's saved input to host memory through hooks of their own, which report it to ``note_offloaded``:
  counted apart, as host bytes, never against the device.
- On CUDA, ``PhasePeaks`` records ``torch.cuda.max_memory_allocated`` for forward, backward (with the
  recompute) and the optimizer step, resetting the peak between phases, plus the device's used memory
  from ``torch.cuda.mem_get_info``: paged optimizer state lives in CUDA managed memory, which the
  caching allocator does not count.

(What the optimizer's state takes, pageable or not, is the optimizer registry's: ``optimizers.py``.)
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from qlora_kit.memory.loss_head import chunked_lm_loss
from qlora_kit.model import vision
from qlora_kit.registries import metric_keys as keys

OUTSIDE = "outside layers"

# Told of a training step's forward pass (``forward_started``) and of its running count after each new
# storage (``saved``): empty but where a test installed faults (fault_seam.install), so a run's step calls
# nothing here
STEP_OBSERVERS: list = []


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers, in order (transformers marks each as a GradientCheckpointingLayer); of a
    vision-language model, its language model's (the vision tower's layers are not the decoder's)."""
    facet = vision.vision_of(getattr(model, "config", None))
    return [
        m
        for name, m in model.named_modules()
        if isinstance(m, GradientCheckpointingLayer) and not vision.on_vision_side(name, facet)
    ]


@dataclass
class SavedBytes:
    total: int = 0  # on the device
    per_layer: dict[str, int] = field(default_factory=dict)
    host: int = 0  # offloaded to host memory (memory.offload_activations)


class SavedTensors:
    """Counts bytes saved for backward while active; use one instance per forward pass. The figure is
    what the forward holds for backward when the ``counting`` block ends (keep the forward's output
    alive until then: its graph holds what was saved); ``result`` gives it from then on."""

    def __init__(self, model: torch.nn.Module, step: bool = False) -> None:
        self.model = model
        self.excluded = {_storage_key(t) for t in [*model.parameters(), *model.buffers()]}
        self.seen: dict[int, tuple[int, str]] = {}
        self.held: dict[int, int] = defaultdict(int)  # saved tensors autograd still holds, per storage
        self.total = 0
        self.host_seen: dict[int, int] = {}
        self.where = OUTSIDE
        self.read: SavedBytes | None = None
        # ``step``: a training step's forward pass, which ``STEP_OBSERVERS`` are told of; the planner's
        # traces and the measurements are not
        self.observers = tuple(STEP_OBSERVERS) if step else ()

    @contextlib.contextmanager
    def counting(self):
        _COUNTING.append(self)
        handles = []
        for index, layer in enumerate(decoder_layers(self.model)):
            handles.append(layer.register_forward_pre_hook(self._enter(f"layer {index}")))
            handles.append(layer.register_forward_hook(self._leave))
        try:
            for observer in self.observers:
                observer.forward_started()
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield self
        finally:
            self.read = self._held_now()  # the forward's figure, before backward releases what it saved
            _COUNTING.remove(self)
            for handle in handles:
                handle.remove()

    def result(self) -> SavedBytes:
        """What the forward holds for backward, as the ``counting`` block ended (inside it: so far)."""
        return self.read if self.read is not None else self._held_now()

    def _held_now(self) -> SavedBytes:
        per_layer: dict[str, int] = defaultdict(int)
        for nbytes, where in self.seen.values():
            per_layer[where] += nbytes
        host = sum(self.host_seen.values())
        return SavedBytes(total=sum(per_layer.values()), per_layer=dict(per_layer), host=host)

    def _enter(self, name: str):
        def hook(module, args):
            self.where = name

        return hook

    def _leave(self, module, args, output) -> None:
        self.where = OUTSIDE

    def _pack(self, tensor: torch.Tensor):
        key = self._count(tensor)
        if key is None:
            return tensor
        self.held[key] += 1
        # Detached: the same storage, without the autograd node. A saved output held with its grad_fn is a
        # cycle through C++ (node -> saved tensor -> grad_fn -> node) that only a backward pass breaks, so
        # a forward or backward pass stopped by an out-of-memory error kept its whole graph alive (13.3
        # GiB of 13.46 at every retry on the H200). autograd gives the unpacked tensor its node back.
        return _Held(tensor.detach(), self, key)

    def _count(self, tensor: torch.Tensor) -> int | None:
        """Count ``tensor``'s storage once while anything holds it; None for a parameter or buffer."""
        key = _storage_key(tensor)
        if key in self.excluded:
            return None
        if key not in self.seen:
            nbytes = tensor.untyped_storage().nbytes()
            self.seen[key] = (nbytes, self.where)
            self.total += nbytes
            for observer in self.observers:
                observer.saved(self.total)
        return key

    def _release(self, key: int) -> None:
        # A storage no saved tensor holds any more was kept for a graph branch the forward itself dropped
        # (DoRA computes its weight norm through lora_B(lora_A(eye)) and detaches it) or, once the
        # figure is fixed, for a backward that is done. Uncounted, and its address free for another
        # storage: the key is the StorageImpl's address, which the allocator reuses (an uncounted
        # reuse hid later saved tensors from the count: DoRA's planned and measured bytes 3-21% low)
        if self.read is not None:
            return
        self.held[key] -= 1
        if self.held[key] <= 0:
            del self.held[key]
            nbytes, _ = self.seen.pop(key)
            self.total -= nbytes


class _Held:
    """What autograd holds for one tensor saved while a ``SavedTensors`` counts: the tensor, and its
    release when autograd lets it go."""

    __slots__ = ("counter", "key", "tensor")

    def __init__(self, tensor: torch.Tensor, counter: SavedTensors, key: int) -> None:
        self.tensor, self.counter, self.key = tensor, counter, key

    def __del__(self) -> None:
        self.counter._release(self.key)


def _unpack(saved):
    return saved.tensor if isinstance(saved, _Held) else saved


_COUNTING: list[SavedTensors] = []  # the counters active now (``note_saved`` reports to them)


def note_saved(tensor: torch.Tensor) -> None:
    """Count a tensor kept for backward outside autograd's saved-tensor hooks (selective checkpointing's
    cache of the ops it keeps) in every active ``SavedTensors``: held until backward, so counted until
    the result is read."""
    for counter in _COUNTING:
        counter._count(tensor)


def note_offloaded(tensor: torch.Tensor) -> None:
    """Count a tensor saved for backward in host memory (an offloaded checkpoint's input) as host bytes in
    every active ``SavedTensors``: it holds no device memory until backward fetches it."""
    for counter in _COUNTING:
        key = _storage_key(tensor)
        if key not in counter.excluded:
            counter.host_seen.setdefault(key, tensor.untyped_storage().nbytes())


def _storage_key(tensor: torch.Tensor) -> int:
    # The storage's own identity (the address of its StorageImpl), not its data pointer: the planner
    # traces with fake tensors, whose storages have no data. A storage is counted while a saved tensor
    # holds it (SavedTensors._release), so no two live counted storages share a key.
    return tensor.untyped_storage()._cdata


def measure_saved_bytes(
    model: torch.nn.Module, batch: dict[str, Any], chunk_tokens: int | None = None
) -> SavedBytes:
    """Bytes saved for backward by one training forward pass of ``model`` (a peft model) on ``batch``,
    with transformers' loss, or with the chunked loss head when ``chunk_tokens`` is given."""
    counter = SavedTensors(model)
    model.train()
    with counter.counting():
        loss = model(**batch).loss if chunk_tokens is None else chunked_lm_loss(model, batch, chunk_tokens)
    # No backward: the figure is fixed as the block ends (``SavedTensors.counting``), and a backward
    # (with checkpointing's recompute) cost more than the forward itself while changing nothing of it;
    # dropping the loss frees its graph and what it saved
    del loss
    return counter.result()


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
            keys.PEAK_FORWARD: self.forward / gib,
            keys.PEAK_BACKWARD: self.backward / gib,
            keys.PEAK_OPTIMIZER: self.optimizer / gib,
            keys.DEVICE_USED: self.device_used / gib,
        }


class HeldBeforeHead(contextlib.AbstractContextManager):
    """In its block, ``held`` becomes what ``counter`` held outside the layers when the model's head was
    first called (None: no head was called)."""

    def __init__(self, model: torch.nn.Module, counter: SavedTensors) -> None:
        self.model, self.counter, self.held, self.handle = model, counter, None, None

    def __enter__(self):
        head = self.model.get_output_embeddings()
        if head is not None:
            self.handle = head.register_forward_pre_hook(self._snapshot)
        return self

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            self.handle.remove()

    def _snapshot(self, module, args) -> None:
        if self.held is None:
            self.held = self.counter.result().per_layer.get(OUTSIDE, 0)
