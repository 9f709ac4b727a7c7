"""Model stage: a numeric self-check of the packed experts against transformers' own forward, at every load.

qlora_kit packs any experts module that transformers' ``use_experts_implementation`` marks, reading its
layout from the attributes the decorator sets (model/moe_experts.py). Those attributes are declarations:
the model's own ``eager`` forward (the undecorated method, which hard-codes the real layout) is the fact.
``check`` runs one layer's packed experts on a small random batch through ``experts_forward`` and through
that eager forward on a copy holding the same weights dequantized, in the compute dtype, and refuses the
load in one line naming the layer and, where flipping one declared attribute makes the two agree, that
attribute: a layout read wrong is never trained. DBRX's flat stacks, which transformers does not declare
(model/moe_flat.py), are checked the same way against its block's own forward (``check_flat_experts``),
naming the families table's entry. ``check_lora`` does the same with LoRA on the experts
(B made non-zero on a copy of the factors) against peft's own ``ParamWrapper`` forward on that copy.

Tolerance: ``TOLERANCE_EPS`` machine epsilons of the compute dtype, relative to the reference's largest
value. Both sides round the same dequantized weights; they differ in the order of a few roundings (the
routing weight applied before or after the down projection, sums per token in another order), each at most
one epsilon of the values it rounds. A wrong layout moves outputs by their own size.
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch

from qlora_kit.errors import RecipeError
from qlora_kit.model import moe_experts, moe_flat

log = logging.getLogger(__name__)

TOLERANCE_EPS = 16  # float32: 1.9e-6, bfloat16: 0.125, float16: 0.016 of the largest output
TOKENS, TOP_K = 16, 2  # the batch: every expert of a small stack gets tokens


def tolerance(dtype: torch.dtype) -> float:
    """The largest difference allowed, relative to the reference's largest value (the module docstring)."""
    return TOLERANCE_EPS * torch.finfo(dtype).eps


def eager_forward(experts):
    """The experts' own forward as the model's authors wrote it, before transformers' decorator wrapped it."""
    return type(experts).forward.__wrapped__


def random_batch(experts, hidden: int, dtype: torch.dtype, seed: int = 0):
    """(tokens, hidden) states and (tokens, k) distinct picks with softmax weights, covering every expert."""
    generator = torch.Generator().manual_seed(seed)
    num_experts = experts.num_experts
    k = min(TOP_K, num_experts)
    tokens = max(TOKENS, num_experts)
    states = torch.randn(tokens, hidden, generator=generator).to(dtype)
    picks = (torch.arange(tokens)[:, None] + torch.arange(k)[None, :]) % num_experts  # (T, k), distinct
    weights = torch.randn(tokens, k, generator=generator).softmax(-1).to(dtype)
    device = next(experts.parameters()).device
    return states.to(device), picks.to(device), weights.to(device)


def dequantized_copy(experts):
    """A copy of the experts module sharing its biases and norm, its stacks dequantized into transformers'
    storage layout as qlora_kit read it (moe_experts.dequantize_experts does the same for the whole model)."""
    replica = copy.copy(experts)
    replica._parameters = dict(experts._parameters)
    replica._modules = dict(experts._modules)
    replica._buffers = dict(experts._buffers)
    moe_experts.dequantize_experts_of(replica)
    return replica


def difference(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """The largest difference, relative to the reference's largest value."""
    scale = reference.float().abs().max().clamp_min(torch.finfo(torch.float32).tiny)
    return float((ours.float() - reference.float()).abs().max() / scale)


def agrees(ours: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> bool:
    return difference(ours, reference) <= tolerance(dtype)


def check(model) -> None:
    """Refuse, in one line, a load whose first packed experts do not compute what transformers computes."""
    packed = [(name, m) for name, m in moe_experts.fused_experts(model) if moe_experts.compute_dtype(m)]
    if packed:
        check_experts(*packed[0])
        return
    flat = [found for found in moe_flat.flat_experts(model) if moe_flat.is_packed(*found[1:])]
    if flat:
        check_flat_experts(*flat[0])


def check_flat_experts(name: str, block, layout) -> None:
    """``check`` on one block of flat stacks (moe_flat.py): its packed forward against the block's own class
    forward on a copy holding the same weights dequantized; a mismatch names the families table's entry."""
    holder = moe_flat.holder_of(block, layout)
    stats = getattr(holder, f"{layout.gate}_4bit")
    replica, unpacked = copy.copy(block), copy.copy(holder)  # the stacks dequantized on the copies only
    replica.__dict__.pop("forward", None)  # the class's own forward
    replica._modules, unpacked._parameters = dict(block._modules), dict(holder._parameters)
    unpacked._modules = dict(holder._modules)
    replica._modules[layout.holder] = unpacked
    for stack in moe_flat.stack_names(layout):
        moe_flat.unpack_stack(unpacked, stack)
    states, picks, weights = random_batch(block, stats.shape[2], stats.dtype)
    with torch.no_grad():
        ours = block(states, picks, weights)
        reference = replica(states[None], picks, weights).view(states.shape)
    found = difference(ours, reference)
    if found > tolerance(stats.dtype):
        raise RecipeError(
            f"model.path: {name}'s 4-bit experts do not compute what its own forward computes on the same "
            f"weights ({found:.2g} of its largest value; tolerance {tolerance(stats.dtype):.2g}): qlora_kit's "
            f"families table reads {layout.holder}.{layout.gate}/{layout.up}/{layout.down} as gate/up/down, "
            "which this model does not (quant.bits 16 loads it with the experts in 16 bits)"
        )


def check_experts(name: str, experts) -> None:
    """``check`` on one packed experts module (``name``: its path, for the refusal)."""
    dtype = moe_experts.compute_dtype(experts)
    replica = dequantized_copy(experts)
    states, picks, weights, reference = eager_reference(experts, replica, dtype)
    try:
        with torch.no_grad():
            ours = moe_experts.experts_forward(experts, states, picks, weights)
        found = difference(ours, reference)
        shown = f"{found:.2g} of its largest value"
    except (RuntimeError, AttributeError) as exc:  # a layout read wrong: shapes that do not multiply, a
        # stack that is not there
        found, shown = float("inf"), " ".join(str(exc).split())[:80]
    if found <= tolerance(dtype):
        log.info(
            "experts self-check: %s matches transformers' eager forward to %.2g of its largest value "
            "(tolerance %.2g)",
            name,
            found,
            tolerance(dtype),
        )
        return
    attribute = misread_attribute(replica, states, picks, weights, reference, dtype)
    where = f"its declared {attribute} is wrong" if attribute else "its declared layout is wrong"
    raise RecipeError(
        f"model.path: {name}'s 4-bit experts do not compute what transformers' eager forward computes on the "
        f"same weights ({shown}; tolerance {tolerance(dtype):.2g} for {str(dtype).removeprefix('torch.')}): "
        f"{where} (quant.bits 16 loads it with the experts in 16 bits)"
    )


def check_lora(peft_model) -> None:
    """Refuse, in one line, LoRA on packed experts whose low-rank forward (moe_experts.LoraExperts) does not
    compute what peft's ParamWrapper computes: on the first wrapped experts module, with a copy of its factors
    whose B is drawn non-zero, ``experts_forward`` against the eager forward on the dequantized weights plus
    peft's own ``get_delta_weight`` (what ParamWrapper's forward adds to the parameter before the base
    forward). Nothing of the model changes."""
    found = next(
        ((n, m) for n, m in peft_model.named_modules() if isinstance(m, moe_experts.LoraExperts)), None
    )  # modules come parents first: the outermost wrapper of the first nest
    experts = found[1].get_base_layer() if found else None
    dtype = moe_experts.compute_dtype(experts) if found else None
    if dtype is None:  # no LoRA on experts, or experts not packed (quant.bits 16 runs peft's own)
        return
    name, layer = found
    on_host = getattr(experts, "experts_on_host", None)  # memory.experts_on_host: the bytes wait on the host
    with on_host.lent() if on_host is not None else contextlib.nullcontext():
        _check_lora_of(name, layer, experts, dtype)


def _check_lora_of(name: str, layer, experts, dtype: torch.dtype) -> None:
    replica, factors = dequantized_copy(experts), {}
    generator = torch.Generator().manual_seed(0)
    while isinstance(layer, moe_experts.LoraExperts):
        adapter = next(a for a in layer.active_adapters if a in layer.lora_A)
        drawn = copy.copy(layer)  # the wrapper's own code and sizes, with a B of its own
        drawn._modules = dict(layer._modules)
        weight = layer.lora_B[adapter].weight
        b = torch.nn.Linear(
            weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype
        )
        b.weight.data = (torch.randn(weight.shape, generator=generator) * 0.1).to(weight)
        drawn.lora_B = torch.nn.ModuleDict({adapter: b})
        factors[layer.parameter_name] = [drawn.low_rank_factors(adapter)]
        with torch.no_grad():  # W + delta in the stack's storage layout, as ParamWrapper's parametrization
            stack = getattr(replica, layer.parameter_name)
            delta = drawn.get_delta_weight(adapter).to(stack.device, stack.dtype)
            setattr(replica, layer.parameter_name, torch.nn.Parameter(stack + delta, requires_grad=False))
        layer = layer.base_layer
    states, picks, weights, reference = eager_reference(experts, replica, dtype)
    with torch.no_grad():
        found = difference(
            moe_experts.experts_forward(experts, states, picks, weights, lora=factors), reference
        )
    if found > tolerance(dtype):
        raise RecipeError(
            f"lora.experts: LoRA on {name}'s 4-bit experts does not compute what peft's ParamWrapper computes on "
            f"the same weights and factors ({found:.2g} of its largest value; tolerance {tolerance(dtype):.2g} for "
            f"{str(dtype).removeprefix('torch.')}): qlora_kit reads its factors wrong here (lora.experts false "
            "trains without them)"
        )
    log.info(
        "experts LoRA self-check: %s matches peft's ParamWrapper to %.2g of its largest value", name, found
    )


def eager_reference(experts, replica, dtype: torch.dtype):
    """A random batch and the eager forward's output on it. The width of the experts' input is whichever of
    the down projection's two stored widths the eager forward runs with (it knows its layout; the declared
    attributes might not)."""
    failure = None
    for hidden in dict.fromkeys(reversed(replica.down_proj.shape[1:])):
        states, picks, weights = random_batch(experts, hidden, dtype)
        try:
            with torch.no_grad():
                return states, picks, weights, eager_forward(experts)(replica, states, picks, weights)
        except RuntimeError as exc:
            failure = exc
    raise failure


def misread_attribute(replica, states, picks, weights, reference, dtype) -> str | None:
    """The one declared layout attribute which, flipped, makes the 16-bit routed loop match the eager forward."""
    for attribute in moe_experts.DECLARED_LAYOUT:
        flipped = copy.copy(replica)
        setattr(flipped, attribute, not getattr(replica, attribute))
        try:
            with torch.no_grad():
                if agrees(moe_experts.experts_forward(flipped, states, picks, weights), reference, dtype):
                    return f"{attribute}={getattr(replica, attribute)}"
        except (RuntimeError, AttributeError, TypeError):
            continue
    return None
