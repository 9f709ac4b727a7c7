"""Memory stage: the tiled MLP — each decoder layer's MLP computed in tiles along the sequence.

A decoder layer's MLP is the widest thing it computes: gate and up projections and their product,
``intermediate`` values a token each (14,336 for Llama-3.1-8B against a hidden size of 4,096), so at long
context one layer's MLP intermediate outweighs every checkpointed layer input together. The MLP treats each
token on its own, so ``memory.mlp_tiles`` splits the sequence into tiles and runs the MLP on one tile at a
time: the forward pass keeps only the MLP's input, and backward recomputes one tile's intermediate at a
time, takes that tile's gradients and frees it before the next (DeepSpeed's ``TiledMLP`` and unsloth's tiled
MLP work so). Inside a checkpointed layer's recompute the same holds, so the layer's working set holds one
tile's intermediate, not the sequence's.

Two autograd nodes, not one: ``_KeepInput`` saves the input and does the tiles' backward, ``_Tiles`` computes
the output without keeping anything and passes its gradient straight up (the MLP maps hidden to hidden, so
the shapes agree). The split is for the checkpointed layer's recompute: torch's non-reentrant checkpoint
stops recomputing once every tensor backward needs is back (its early stop), and the MLP's input is the last
one a layer saves when nothing after the MLP saves its output (Llama's residual add does not), so the
recompute stops before ``_Tiles`` and the MLP runs twice a step, as untiled under full checkpointing. One
node (or each tile under its own ``checkpoint``, as this module did first) computes the MLP a third time
there (the step times per layout: benchmarks/results/long-context-cpu.md and long-context-real-cpu.md). A
family whose post-MLP norm saves the output (Gemma-2's) recomputes the tiles as before: correct, not faster.

The gradients of the MLP's trainable weights (LoRA) leave ``_KeepInput`` as gradients of its inputs, so
they reach the weights through autograd's own accumulation, where DDP's and FSDP2's hooks wait for them. The
tiles' backward replays the forward's random state (LoRA dropout draws the same masks) and autocast.

``auto`` takes ``ceil(tokens / hidden)`` tiles (unsloth's TiledMLP rule: a tile of ``hidden`` tokens has an
intermediate of ``hidden x intermediate`` values, no bigger than the layer's input once the sequence is
longer than ``intermediate``); an integer fixes the count. ``enable_mlp_tiles`` wraps the ``mlp`` module
of each decoder layer; the weights, LoRA and the 4-bit layers are untouched.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass, field

import torch

from qlora_kit.memory.accounting import decoder_layers


def tile_count(setting: int | str, tokens: int, hidden: int) -> int:
    """How many tiles ``memory.mlp_tiles`` gives a sequence of ``tokens`` (never more than tokens)."""
    tiles = math.ceil(tokens / hidden) if setting == "auto" else int(setting)
    return max(1, min(tiles, tokens))


def enable_mlp_tiles(model: torch.nn.Module, setting: int | str) -> int:
    """Tile the MLP of every decoder layer; returns how many MLPs were tiled (0 when the setting is 1)."""
    if setting == 1:
        return 0
    hidden = model.config.get_text_config().hidden_size
    tiled = 0
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if mlp is None or getattr(mlp, "_untiled_forward", None) is not None:
            continue
        mlp._untiled_forward = mlp.forward
        mlp.forward = types.MethodType(_tiled_forward(setting, hidden), mlp)
        tiled += 1
    return tiled


def _tiled_forward(setting: int | str, hidden: int):
    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # hidden_states: (B, T, C); the MLP maps each of the T positions on its own
        tiles = tile_count(setting, hidden_states.shape[-2], hidden)
        if tiles == 1:
            return self._untiled_forward(hidden_states, *args, **kwargs)
        if not torch.is_grad_enabled():  # evaluation: nothing is kept anyway
            parts = hidden_states.tensor_split(tiles, dim=-2)
            return torch.cat([self._untiled_forward(part, *args, **kwargs) for part in parts], dim=-2)
        return run_tiles(_TileRun(self, tiles, args, kwargs), hidden_states)

    return forward


@dataclass
class _TileRun:
    """One call of a tiled MLP: what its backward needs to recompute the tiles as the forward ran them."""

    mlp: torch.nn.Module
    tiles: int
    args: tuple
    kwargs: dict
    rng: tuple | None = None  # (CPU state, device states) as the forward's first tile found them
    autocast: tuple | None = None  # (device type, enabled, dtype) of the forward
    weights: list[torch.Tensor] = field(default_factory=list)  # the MLP's trainable weights

    def parts(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return hidden.tensor_split(self.tiles, dim=-2)

    def record(self, hidden: torch.Tensor) -> None:
        device = hidden.device
        devices = [device] if device.type == "cuda" else []
        self.rng = (torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices])
        self.autocast = (
            device.type,
            torch.is_autocast_enabled(device.type),
            torch.get_autocast_dtype(device.type),
        )

    def output(self, hidden: torch.Tensor) -> torch.Tensor:
        self.record(hidden)
        return torch.cat(
            [self.mlp._untiled_forward(p, *self.args, **self.kwargs) for p in self.parts(hidden)], -2
        )

    def gradients(self, hidden: torch.Tensor, grad_output: torch.Tensor) -> tuple[torch.Tensor, list]:
        """The input's gradient and the trainable weights', one tile's intermediate alive at a time."""
        grad_input = torch.empty_like(hidden)
        grad_weights: list[torch.Tensor | None] = [None] * len(self.weights)
        device_type, enabled, dtype = self.autocast
        cpu_state, device_states = self.rng
        devices = [hidden.device] if device_states else []
        with torch.random.fork_rng(devices=devices, device_type=device_type):
            torch.set_rng_state(cpu_state)
            for device, state in zip(devices, device_states, strict=True):
                torch.cuda.set_rng_state(state, device)
            start = 0
            for part, grad in zip(self.parts(hidden), self.parts(grad_output), strict=True):
                part = part.detach().requires_grad_(hidden.requires_grad)
                with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                    out = self.mlp._untiled_forward(part, *self.args, **self.kwargs)
                inputs = [part] if part.requires_grad else []
                found = torch.autograd.grad(out, inputs + self.weights, grad, allow_unused=True)
                if inputs:
                    grad_input[..., start : start + part.shape[-2], :] = found[0]
                for i, g in enumerate(found[len(inputs) :]):
                    if g is not None:
                        grad_weights[i] = g if grad_weights[i] is None else grad_weights[i] + g
                start += part.shape[-2]
        return grad_input, grad_weights


class _KeepInput(torch.autograd.Function):
    """The tiled MLP's input, saved; in backward, the tiles recomputed and their gradients taken."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, run: _TileRun, *weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(hidden)
        ctx.run = run
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (hidden,) = ctx.saved_tensors
        grad_input, grad_weights = ctx.run.gradients(hidden, grad_output)
        return (grad_input if ctx.needs_input_grad[0] else None), None, *grad_weights


class _Tiles(torch.autograd.Function):
    """The tiled MLP's output, nothing kept; its gradient passes straight to ``_KeepInput``."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, run: _TileRun) -> torch.Tensor:
        return run.output(hidden)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        return grad_output, None


def run_tiles(run: _TileRun, hidden: torch.Tensor) -> torch.Tensor:
    """The MLP's output, its tiles recomputed one at a time in backward (module docstring)."""
    run.weights = [w for w in run.mlp.parameters() if w.requires_grad]
    return _Tiles.apply(_KeepInput.apply(hidden, run, *run.weights), run)
