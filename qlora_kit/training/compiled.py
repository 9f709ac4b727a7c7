"""Training stage: regional compilation of the decoder layers (``train.compile``), after LoRA is attached.

Each decoder layer's training forward is compiled as ``nn.Module.compile`` does (inductor), as torchtune and
torchtitan do (evaluation and generation run it eager: their shapes change with each decoded token): all
layers of a class run the same ``forward`` code object, and torch inlines the module's parameters as graph
inputs (``inline_inbuilt_nn_modules``), so one compiled graph serves every layer. Compared with compiling
the whole model (the Trainer's ``torch_compile``): the graph is one layer, not the model (a fraction of
the compile time), and the embedding's ``requires_grad_()`` hook, the loss head and the checkpointing
machinery stay outside it, which is where the whole-model compile broke its graph (7 breaks under the
defaults: benchmarks/results/compile-cpu.md).

Checkpointing is compiled with the layer: transformers' ``GradientCheckpointingLayer`` checkpoints inside
the layer's ``forward``, which the compiled call runs, so dynamo traces torch's checkpoint as its
higher-order op and the partitioner recomputes what it lets go (full and every_n: everything; selective:
what its op policy does not keep, memory/selective.py, whose forward context hands the region's
``ac_graph_id`` down to torch's caching mode for that). One kind of layer is left eager, with its reason in
the log: a layer whose checkpoint keeps its input in host memory (``memory.offload_activations``): dynamo
cannot trace the ``saved_tensors_hooks`` active around it (two graph breaks a step, then an eager layer).

A mixture's layer is compiled but for its router and routed experts (``regions_around``): each expert's
matmuls follow the batch's routing, counts read to the host once a layer (model/expert_matmul.py), which
no graph holds without a break; its attention, norms and shared experts are compiled each as a region of
its own, by their classes' ``forward`` (one graph per class for all layers), while the checkpoint around
the layer stays eager and recomputes the compiled regions in backward. A hybrid's recurrent layers stay
eager (``RECURRENT_REASON``), its attention layers compile. A vision-language model's decoder layers compile as a
text model's: the image runs are merged into the hidden states before the first layer, so a layer sees
only another sequence length (tests/e2e/test_compile_layers.py: image batches of Qwen2.5-VL, no graph
break, two graphs, eager's losses; LLaVA, Gemma 3 and Qwen3-VL gave the same by hand).

Shapes: the first call compiles for its shapes; a call with another sequence length (packing, the last
batch, images) recompiles once with the changed sizes marked dynamic (torch's automatic dynamic shapes),
and every later length reuses that graph: two compiles per layer class for training, whatever the data.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field

import torch

from qlora_kit.memory import checkpointing
from qlora_kit.memory.accounting import decoder_layers
from qlora_kit.model import moe_experts, recurrent

log = logging.getLogger(__name__)

OFFLOAD_REASON = (
    "dynamo cannot trace the host-offload saved_tensors_hooks around it (memory.offload_activations)"
)
RECURRENT_REASON = (
    "a recurrent (linear-attention) layer: transformers' torch path of its gated delta rule loops over the "
    "sequence in Python, which the graph unrolls (the tiny Qwen3.5's run built and stepped three times in "
    "193 s with them compiled; an eager run and one with its attention layer compiled, 26 s together)"
)
ROUTED_REASON = (
    "the router and routed experts run eager (each expert's matmuls follow the batch's routing, "
    "read to the host once a layer); the rest of each layer is compiled"
)


@dataclass
class CompiledLayers:
    """Which decoder layers were compiled, each eager one's reason, and each layer compiled but for a part
    (``partly``: what stays eager in it)."""

    compiled: list[int] = field(default_factory=list)
    eager: dict[int, str] = field(default_factory=dict)
    partly: dict[int, str] = field(default_factory=dict)

    def describe(self) -> str:
        text = f"{len(self.compiled)} of {len(self.compiled) + len(self.eager)} decoder layers compiled"
        text += "".join(f"; in {count_of(self.partly, r)}: {r}" for r in sorted(set(self.partly.values())))
        return text + "".join(f"; eager: {reason}" for reason in sorted(set(self.eager.values())))


def count_of(reasons: dict[int, str], reason: str) -> str:
    count = sum(1 for value in reasons.values() if value == reason)
    return f"{count} layer" + ("s" if count > 1 else "")


def compile_decoder_layers(model: torch.nn.Module) -> CompiledLayers:
    """Compile each decoder layer of ``model`` that can be (see the module docstring), in place."""
    layers = decoder_layers(model)
    result = CompiledLayers()
    offloaded = set(checkpointing.offloaded_layers(model))
    stateful = _recurrent_layers(model, len(layers))
    routed = routed_paths(model)
    for index, layer in enumerate(layers):
        if index in offloaded:
            result.eager[index] = OFFLOAD_REASON
        elif index in stateful:
            result.eager[index] = RECURRENT_REASON
        elif any(moe_experts.layer_holds(layer, path) for path in routed):
            for region in regions_around(layer, routed):
                _compile_region(region)
            result.partly[index] = ROUTED_REASON
        else:
            _compile_training_forward(layer)
        if index not in result.eager:
            result.compiled.append(index)
    log.info("train.compile: %s", result.describe())
    return result


def uncompile_decoder_layers(model: torch.nn.Module) -> None:
    """Undo ``compile_decoder_layers``: every layer and region runs eager again."""
    for layer in decoder_layers(model):
        for module in layer.modules():
            module._compiled_call_impl = None  # nn.Module.compile's attribute
            region = _region_forward(module)
            if region is not None:  # the forward it had: its class's, or one set on it (accelerate's hooks)
                del module.forward
                if region.own_forward is not None:
                    module.forward = region.own_forward


def routed_paths(model: torch.nn.Module) -> tuple[str, ...]:
    """A mixture layer's router and routed experts, relative to the layer (() for a dense model)."""
    facet = moe_experts.experts_of(model)[1]
    if facet is None:
        return ()
    return tuple(path for path in (facet.router, facet.experts) if path)


def regions_around(layer: torch.nn.Module, eager_paths: tuple[str, ...]) -> list[torch.nn.Module]:
    """The largest submodules of ``layer`` that hold parameters and none of ``eager_paths``: a mixture
    layer's attention, its norms and its shared experts, not the block that routes (its router and experts
    are eager, its shared experts are a region of their own)."""
    regions = []

    def walk(module: torch.nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = prefix + name
            if path in eager_paths:
                continue
            if any(eager.startswith(path + ".") for eager in eager_paths):
                walk(child, path + ".")
            elif next(child.parameters(), None) is not None:
                regions.append(child)

    walk(layer, "")
    return regions


def _compile_training_forward(layer: torch.nn.Module) -> None:
    """``nn.Module.compile`` for training's forward (and checkpointing's recompute) only: evaluation and
    generation call the layer eager, as their shapes change with every decoded token and KV cache."""
    compiled_call = torch.compile(layer._call_impl)
    eager_call = layer._call_impl

    def call(*args, **kwargs):
        if layer.training and torch.is_grad_enabled():
            return compiled_call(*args, **kwargs)
        return eager_call(*args, **kwargs)

    layer._compiled_call_impl = call  # what Module.__call__ runs instead of _call_impl when set


def _compile_region(region: torch.nn.Module) -> None:
    """``_compile_training_forward`` for a part of a layer, by its ``forward`` (its class's code object):
    ``_call_impl``'s one code object would hold every region class's graphs under one recompile limit, and
    the region's own hooks (FSDP's, accelerate's) stay eager around it."""
    eager_forward = region.forward
    compiled_forward = torch.compile(eager_forward)

    def forward(*args, **kwargs):
        if region.training and torch.is_grad_enabled():
            return compiled_forward(*args, **kwargs)
        return eager_forward(*args, **kwargs)

    forward.own_forward = region.__dict__.get("forward")  # what uncompile_decoder_layers puts back
    region.forward = forward


def _region_forward(module: torch.nn.Module):
    """``_compile_region``'s forward on ``module`` (None: it has none)."""
    forward = module.__dict__.get("forward")
    return forward if hasattr(forward, "own_forward") else None


def decoder_layers_compiled(model: torch.nn.Module) -> bool:
    """Whether any decoder layer of ``model``, or a region of one, runs compiled."""
    return any(
        module._compiled_call_impl is not None or _region_forward(module) is not None
        for layer in decoder_layers(model)
        for module in layer.modules()
    )


def all_eager_reason(model: torch.nn.Module) -> str | None:
    """Why every decoder layer of ``model`` would stay eager whatever the checkpointing (None: some compile)."""
    count = len(decoder_layers(model))
    return RECURRENT_REASON if count and len(_recurrent_layers(model, count)) == count else None


def _recurrent_layers(model: torch.nn.Module, count: int) -> frozenset[int]:
    config = getattr(model, "config", None)
    return recurrent.recurrent_layers(config, count) if config is not None else frozenset()


@functools.cache
def compiler_works() -> tuple[bool, str]:
    """Whether inductor compiles and runs a small function on this device (a C++ compiler on a CPU,
    Triton on a GPU), with what it found; cached for the process."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.arange(8, dtype=torch.float32, device=device)
    try:
        compiled = torch.compile(_probe, backend="inductor", fullgraph=True)
        ok = torch.equal(compiled(x), _probe(x))
    except Exception as exc:  # any failure of the toolchain means: do not compile
        return (
            False,
            f"inductor on {device} failed: {exc.__class__.__name__}: {str(exc).splitlines()[0][:200]}",
        )
    return ok, f"inductor on {device} (torch {torch.__version__})" + ("" if ok else ": wrong result")


def _probe(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x * 2 - 3).sum(-1, keepdim=True) + x


@functools.cache
def least_compile_seconds() -> float:
    """Seconds inductor takes here to compile a graph of two fused kernels, the least any compile costs on
    this machine in this process (a decoder layer's forward and backward are many more): timed after
    ``compiler_works``, whose first compile also pays the one-off start of the toolchain (12-15 s on 2
    loaded cores, against 0.4 s for this one from inductor's disk cache and 12 s without it)."""
    compiler_works()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.arange(8, dtype=torch.float32, device=device)
    start = time.perf_counter()
    torch.compile(_timed_probe, backend="inductor", fullgraph=True)(x)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _timed_probe(x: torch.Tensor) -> torch.Tensor:  # another code object than _probe: compiled afresh
    return torch.tanh(x * 3 + 1).sum(-1, keepdim=True) * x
