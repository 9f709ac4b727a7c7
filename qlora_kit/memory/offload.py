"""Memory stage: offloaded checkpoints — each checkpointed decoder layer's saved input kept in host memory.

With ``memory.offload_activations``, what a checkpointed layer keeps for its recompute (its inputs: torch's
non-reentrant checkpoint saves them through autograd's saved-tensor hooks, ``accounting.py``) goes to host
memory in the forward pass and comes back for the recompute in backward. ``checkpointing.py`` wraps each
checkpointed layer's checkpoint function in ``offloading()``; nothing else changes, so the recompute, the
selective policy and the fault injector run as without offload.

- On CUDA the copies run on a side stream: device to host as soon as the layer's input is ready (the
  forward pass goes on meanwhile), and, in backward, the input of the layer that recomputes next is fetched
  while the current one recomputes (backward visits the layers in reverse, so each fetch starts the one
  packed before it: a prefetch one layer ahead). Host buffers are pinned, so the copies are asynchronous.
- Without an accelerator the same code path copies host to host, no streams: CPU tests prove the losses
  and gradients equal the run without offload, and the accounting counts the offloaded bytes as host bytes.

Why not transformers' ``activation_checkpointing_enable(offload=True)``: it wraps torch's ``save_on_cpu``,
whose copies run on the compute stream (each layer waits for its own copy, and backward for each fetch), and
it raises without an accelerator ("pin_memory=True requires a CUDA or other accelerator backend").
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch

from qlora_kit.memory import accounting


class OffloadedTensor:
    """One saved tensor in host memory, and (once fetched) its copy back on its device."""

    def __init__(self, tensor: torch.Tensor, previous: OffloadedTensor | None) -> None:
        self.device = tensor.device
        # the tensor packed just before this one: backward unpacks in reverse, so it is the next to need
        # fetching once this one is back (a weak reference: the graph, not this chain, owns the buffers)
        self.previous = weakref.ref(previous) if previous is not None else None
        self.fetched: torch.Tensor | None = None
        self.fetched_event = None
        if self.device.type == "cuda":
            stream = _side_stream(self.device)
            stream.wait_stream(
                torch.cuda.current_stream(self.device)
            )  # the input is ready on the compute stream
            with torch.cuda.stream(stream):
                self.host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=True)
                self.host.copy_(tensor, non_blocking=True)
                self.stored_event = stream.record_event()
            tensor.record_stream(stream)  # the allocator must not reuse it before the copy has read it
        else:
            self.host = tensor.detach().clone()  # host to host: the same path, no streams
            self.stored_event = None

    def fetch(self) -> None:
        """Start the copy back to the device (asynchronous on CUDA)."""
        if self.fetched is not None:
            return
        if self.device.type != "cuda":
            self.fetched = self.host
            return
        stream = _side_stream(self.device)
        with torch.cuda.stream(stream):
            stream.wait_event(self.stored_event)
            self.fetched = self.host.to(self.device, non_blocking=True)
            self.fetched_event = stream.record_event()

    def unpack(self) -> torch.Tensor:
        self.fetch()
        if self.fetched_event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.fetched_event)
            self.fetched.record_stream(current)  # freed after the recompute that reads it, not before
        previous = self.previous() if self.previous is not None else None
        if previous is not None:
            previous.fetch()  # the layer backward recomputes next: its input travels while this one computes
        tensor, self.fetched = self.fetched, None
        return tensor


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
_last_packed: weakref.ref | None = None


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def _pack(tensor: torch.Tensor) -> OffloadedTensor:
    global _last_packed
    previous = _last_packed() if _last_packed is not None else None
    handle = OffloadedTensor(tensor, previous)
    _last_packed = weakref.ref(handle)
    accounting.note_offloaded(tensor)
    return handle


def _unpack(handle: OffloadedTensor) -> torch.Tensor:
    return handle.unpack()


@contextlib.contextmanager
def offloading() -> Iterator[None]:
    """Every tensor autograd saves inside goes to host memory until backward needs it."""
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield


def offloaded_checkpoint(function, *args, checkpoint_fn, **kwargs):
    """A decoder layer's checkpoint function with its saved inputs in host memory (``checkpoint_fn`` is
    transformers' own, torch's ``checkpoint``, with the run's keyword arguments bound)."""
    with offloading():
        return checkpoint_fn(function, *args, **kwargs)
