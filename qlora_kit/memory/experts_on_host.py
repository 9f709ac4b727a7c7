"""Memory stage: a mixture's frozen 4-bit experts kept in host memory, brought to the device a layer at a
time (``memory.experts_on_host``).

A mixture's routed experts are most of its weights (Qwen3-30B-A3B in 4 bits: ~14.5 of ~17 GB) and they are
frozen: only their LoRA trains. ``keep_experts_on_host`` copies every experts module's packed weights and
quantization statistics (whatever tensors model/moe_experts.py gave it, found by walking the module) to
host memory, pinned on CUDA, and swaps each for a tensor of its shape on the device whose storage is
empty (``untyped_storage().resize_(0)``, the way FSDP frees a gathered parameter), refilled from the host
copy when the layer needs it. From then on every holder of them, the module, a QuantState built from
them, and the views bitsandbytes' ``MatMul4Bit`` keeps in its ``ctx`` for backward, sees the refilled
bytes: nothing in the experts' code changes.

Loading calls it (``loading.load_base_model``'s ``experts_to_host``): the model is loaded and its experts
packed on the host, the experts are kept there as above, and only then does the rest of the model go to
the device. So the experts' bytes, 16-bit or packed, never sit on the device at load: its peak there is
the rest of the model plus one layer's experts while their empty device tensors are made
(``experts_plan.py`` plans it).

When the bytes are on the device (hooks on the module that calls the experts, its "block"):
- forward: filled before the block runs, emptied after it; the next layer's copy starts meanwhile;
- backward: filled when the gradient reaches the block's output (an identity function there), emptied
  when it has passed the block's input (an identity there too, anchored to a tensor that requires grad so
  its backward always runs); the previous layer's copy starts meanwhile;
- recompute (a checkpointed layer's forward again, inside its backward): it finds the bytes already
  filled for that backward, or fills them and the backward uses the same copy. One copy a layer in the
  forward pass, one in the backward pass, recompute included.
So at most two layers' experts are on the device at a time (the one computing, the one arriving).

On CUDA the copies run on a side stream from pinned memory, one layer ahead, as ``offload.py`` prefetches
saved inputs; the compute stream waits for a layer's copy only when it needs that layer. On the CPU the
same code copies host to host: the "device" storage and the host copy are two storages, the copies real
and counted (``LayerExperts.copies``), so the tests prove the losses, the gradients and the copy counts.
"""

from __future__ import annotations

import collections
import contextlib
import logging

import torch

from qlora_kit.errors import RecipeError
from qlora_kit.model import moe_experts

log = logging.getLogger(__name__)

FORWARD, RECOMPUTE, BACKWARD = "forward", "recompute", "backward"  # the passes a copy is counted in
_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


class LayerExperts:
    """One layer's experts: each storage they use, its host copy, and whether the device's is filled."""

    def __init__(
        self, index: int, storages: list[torch.UntypedStorage], host: list[torch.Tensor], device: torch.device
    ) -> None:
        # storages: on the device, emptied; host: their bytes, one uint8 tensor each
        self.index, self.device, self.storages, self.host = index, device, storages, host
        self.nbytes = sum(h.numel() for h in host)
        self.filled, self.arriving = False, None  # arriving: the side stream's event of a copy under way
        self.copies: collections.Counter = collections.Counter()  # pass -> copies made in it

    def fetch(self, phase: str) -> None:
        """Start filling the device storages from the host (asynchronous on CUDA); nothing when filled."""
        if self.filled:
            return
        self._fill()
        self.copies[phase] += 1

    @contextlib.contextmanager
    def lent(self):
        """The bytes on the device for a check outside training (experts_selfcheck.check_lora, once a
        load), then released: no pass of a step, so not among the counted copies."""
        if self.filled:
            yield
            return
        self._fill()
        try:
            self.ready("lent")
            yield
        finally:
            self.release()

    def _fill(self) -> None:
        for storage, host in zip(self.storages, self.host, strict=True):
            storage.resize_(host.numel())  # allocated on the compute stream, which frees it again
        if self.device.type == "cuda":
            side = _side_stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))  # the memory is free on that stream
            with torch.cuda.stream(side):
                for storage, host in zip(self.storages, self.host, strict=True):
                    _bytes_of(storage, self.device).copy_(host, non_blocking=True)
                self.arriving = side.record_event()
        else:
            for storage, host in zip(self.storages, self.host, strict=True):
                _bytes_of(storage, self.device).copy_(host)
        self.filled = True

    def ready(self, phase: str) -> None:
        """The bytes on the device before the compute stream reads them."""
        self.fetch(phase)
        if self.arriving is not None:
            torch.cuda.current_stream(self.device).wait_event(self.arriving)
            self.arriving = None

    def release(self) -> None:
        """Empty the device storages (the tensors keep their shapes; their bytes are the host's)."""
        if not self.filled:
            return
        if self.arriving is not None:  # a copy nobody waited for must land before its memory is reused
            torch.cuda.current_stream(self.device).wait_event(self.arriving)
            self.arriving = None
        for storage in self.storages:
            storage.resize_(0)
        self.filled = False


class ExpertsOnHost:
    """Every mixture layer's experts in host memory, and the hooks that bring each to the device."""

    def __init__(self, layers: list[LayerExperts]) -> None:
        self.layers = layers
        self.handles: list = []

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def copies(self) -> list[collections.Counter]:
        """Each layer's copies so far, by pass (forward, recompute, backward)."""
        return [collections.Counter(layer.copies) for layer in self.layers]

    def neighbour(self, layer: LayerExperts, step: int) -> LayerExperts | None:
        index = layer.index + step
        return self.layers[index] if 0 <= index < len(self.layers) else None

    def before_block(self, layer: LayerExperts, args: tuple, kwargs: dict):
        if _in_backward():  # a checkpointed layer's recompute: its backward empties the storages
            layer.ready(RECOMPUTE)
            return None
        layer.ready(FORWARD)
        following = self.neighbour(layer, 1)
        if following is not None:
            following.fetch(FORWARD)  # one layer ahead: it travels while this one computes
        if not torch.is_grad_enabled():
            return None
        if args and isinstance(args[0], torch.Tensor):
            return (_LeaveInBackward.apply(args[0], _anchor(args[0]), layer), *args[1:]), kwargs
        states = kwargs.get("hidden_states")
        if isinstance(states, torch.Tensor):
            return args, {**kwargs, "hidden_states": _LeaveInBackward.apply(states, _anchor(states), layer)}
        raise RuntimeError(f"memory.experts_on_host: layer {layer.index}'s block has no hidden states input")

    def after_block(self, layer: LayerExperts, output):
        if _in_backward():
            return None
        layer.release()
        if not torch.is_grad_enabled():
            return None
        if isinstance(output, torch.Tensor):
            return _EnterInBackward.apply(output, layer, self)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (_EnterInBackward.apply(output[0], layer, self), *output[1:])
        raise RuntimeError(f"memory.experts_on_host: layer {layer.index}'s block returns no tensor")

    def remove(self) -> None:
        """Hooks off and every layer's bytes back on the device (for merging or saving the 4-bit model)."""
        for handle in self.handles:
            handle.remove()
        for layer in self.layers:
            layer.ready(FORWARD)


class _LeaveInBackward(torch.autograd.Function):
    """Identity on a block's input; its backward runs once the block's backward is done: the layer's
    experts leave the device."""

    @staticmethod
    def forward(ctx, states, anchor, layer):
        ctx.layer = layer
        return states.view_as(states)

    @staticmethod
    def backward(ctx, grad):
        ctx.layer.release()
        return grad, None, None


class _EnterInBackward(torch.autograd.Function):
    """Identity on a block's output; its backward runs before the block's: the layer's experts come back
    (and the layer backward visits next starts its copy)."""

    @staticmethod
    def forward(ctx, output, layer, owner):
        ctx.layer, ctx.owner = layer, owner
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad):
        ctx.layer.ready(BACKWARD)
        previous = ctx.owner.neighbour(ctx.layer, -1)
        if previous is not None:
            previous.fetch(BACKWARD)
        return grad, None, None


def _anchor(states: torch.Tensor) -> torch.Tensor:
    # the input may not require grad (a first layer under frozen embeddings): the identity's backward must
    # run regardless, or the layer would stay on the device
    return torch.empty(0, device=states.device, requires_grad=True)


def _in_backward() -> bool:
    # torch's own test for "inside the autograd engine" (torch.utils.checkpoint reads it too): a forward
    # run there is a checkpointed layer's recompute
    return torch._C._current_graph_task_id() != -1


def _bytes_of(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over the whole storage (its current size)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (storage.nbytes(),))


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


def keep_experts_on_host(
    model: torch.nn.Module, field: str | None = None, device: torch.device | None = None
) -> ExpertsOnHost | None:
    """Keep every experts module's frozen tensors of ``model`` (the 4-bit base, before peft wraps it) in host
    memory, each swapped for an empty tensor of its shape on ``device`` (default: where the experts are;
    loading passes the GPU while they are still on the host), and hook their blocks. A model without fused
    experts: None, or with ``field`` (the recipe's, asking for it) a RecipeError naming it."""
    found = [(name, m) for name, m in moe_experts.fused_experts(model) if not hasattr(m, "base_layer")]
    if not found:
        if field is not None:
            model_type = getattr(getattr(model, "config", None), "model_type", "this model")
            raise RecipeError(
                f"{field}: {model_type} is not a mixture of experts (it has no experts to keep)"
            )
        return None
    elsewhere = _storages_outside(model, [m for _, m in found])
    layers, owners = [], []
    for name, experts in found:
        target = device or next(iter(experts.parameters())).device
        layers.append(LayerExperts(len(layers), *_swap_to_host(experts, elsewhere, target), target))
        owners.append(model.get_submodule(name.rpartition(".")[0]))
    on_host = ExpertsOnHost(layers)
    for layer, block in zip(layers, owners, strict=True):
        on_host.handles.append(
            block.register_forward_pre_hook(
                lambda _, args, kwargs, layer=layer: on_host.before_block(layer, args, kwargs),
                with_kwargs=True,
            )
        )
        on_host.handles.append(
            block.register_forward_hook(
                lambda _, args, output, layer=layer: on_host.after_block(layer, output)
            )
        )
    for (_, experts), layer in zip(found, layers, strict=True):
        experts.experts_on_host = layer  # read back by layers_on_host
    log.info(
        "memory.experts_on_host: %d layers' experts (%.2f GiB) in host memory, %.2f MiB a layer",
        len(layers),
        on_host.nbytes / 2**30,
        on_host.nbytes / len(layers) / 2**20,
    )
    return on_host


def _swap_to_host(
    experts: torch.nn.Module, elsewhere: set[int], device: torch.device
) -> tuple[list[torch.UntypedStorage], list[torch.Tensor]]:
    """Copy the bytes of each storage of ``experts``' frozen tensors that nothing else reads to host memory
    (pinned on CUDA) and swap each tensor for one of its shape, dtype and strides on ``device``, over a new
    storage emptied once all are made (tensors that shared a storage share the new one). Returns the device
    storages and their host copies. The old tensors are freed with the module's last reference to them."""
    pinned = device.type == "cuda"
    swapped: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}  # old storage -> (device, host)
    for module in experts.modules():
        for slots in (module._parameters, module._buffers):  # swapped in place, as torch's own Module._apply
            for name, tensor in list(slots.items()):
                if tensor is None or tensor.requires_grad or not tensor.untyped_storage().nbytes():
                    continue
                old = tensor.untyped_storage()
                if old.data_ptr() in elsewhere:
                    continue
                if old.data_ptr() not in swapped:
                    host = torch.empty(old.nbytes(), dtype=torch.uint8, pin_memory=pinned)
                    host.copy_(_bytes_of(old, tensor.device))
                    swapped[old.data_ptr()] = (torch.UntypedStorage(old.nbytes(), device=device), host)
                storage = swapped[old.data_ptr()][0]
                moved = torch.empty(0, dtype=tensor.dtype, device=device).set_(
                    storage, tensor.storage_offset(), tensor.shape, tensor.stride()
                )
                slots[name] = (
                    torch.nn.Parameter(moved, False) if isinstance(tensor, torch.nn.Parameter) else moved
                )
    for storage, _ in swapped.values():
        storage.resize_(0)  # made at full size, so that set_ above never grew it
    return [storage for storage, _ in swapped.values()], [host for _, host in swapped.values()]


def layers_on_host(model: torch.nn.Module) -> list[LayerExperts]:
    """Each mixture layer's experts kept in host memory, in layer order ([] when the feature is off)."""
    return [
        m.experts_on_host
        for m in model.modules()
        if isinstance(getattr(m, "experts_on_host", None), LayerExperts)
    ]


def _frozen_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    tensors = [*module.parameters(), *module.buffers()]
    return [t for t in tensors if not t.requires_grad and t.untyped_storage().nbytes()]


def _storages_outside(model: torch.nn.Module, experts: list[torch.nn.Module]) -> set[int]:
    """The storages some tensor outside one experts module reads: another layer's experts (a code book
    bitsandbytes shares), the rest of the model, a Linear4bit's quantization state. They stay resident."""
    inside = {id(t) for module in experts for t in _frozen_tensors(module)}
    seen: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers(), *_quant_state_tensors(model)]:
        if id(tensor) not in inside:
            seen.add(tensor.untyped_storage().data_ptr())
    owners = collections.Counter(
        ptr for module in experts for ptr in {t.untyped_storage().data_ptr() for t in _frozen_tensors(module)}
    )
    return seen | {ptr for ptr, count in owners.items() if count > 1}


def _quant_state_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    found = []
    for parameter in model.parameters():
        state = getattr(parameter, "quant_state", None)
        if state is not None:
            found += [state.absmax, state.code]
            if state.nested:
                found += [state.state2.absmax, state.state2.code]
    return [t for t in found if isinstance(t, torch.Tensor)]
