"""Model stage: a mixture whose experts are flat 2-D stacks transformers does not declare (DBRX), in 4 bits.

DBRX keeps its experts as three (experts x intermediate, hidden) parameters on one module (``w1`` the gate,
``v1`` the up projection, ``w2`` the down projection stored (in, out) per expert), run by its block's own
loop, outside transformers' experts interface and its ``use_experts_implementation`` declaration. What
each stack is cannot be read from the module, so the families table says it (``families.FLAT_EXPERTS``);
the stacks' shapes are read from the module and checked against its expert count. ``pack_flat_experts``
(called by ``moe_experts.quantize_experts``) packs each expert of each stack in 4 bits (expert_stacks.py)
and runs the block by ``flat_experts_forward``: the picks sorted by expert, each expert's matmuls on its
tokens only through bitsandbytes' ``matmul_4bit`` (expert_matmul.each_expert, the CPU's loop on any device).

LoRA on these stacks is peft's own form for a 2-D parameter (target_parameters: one A (r, hidden) and one
B (experts x intermediate, r) a stack, B @ A the update of the whole stack), so that plain peft loads the
adapter onto transformers' 16-bit model and merges it; ``LoraFlatExperts`` holds those factors, and the
forward applies each expert's slice of the update in low-rank form (``low_rank_factors``).
"""

from __future__ import annotations

import functools

import torch
from peft.tuners.lora.layer import ParamWrapper

from qlora_kit.errors import RecipeError
from qlora_kit.model import expert_matmul
from qlora_kit.model.expert_stacks import pack_stack, unpack_stack
from qlora_kit.registries import families


def flat_experts(model) -> list[tuple[str, torch.nn.Module, families.FlatExperts]]:
    """(name, block, layout) of every block of ``model`` holding flat expert stacks (its families entry's)."""
    config = getattr(model, "config", None)
    layout = families.FLAT_EXPERTS.get(getattr(config, "model_type", ""))
    if layout is None:
        return []
    return [
        (name, module, layout)
        for name, module in model.named_modules()
        if hasattr(module, "num_experts") and isinstance(holder_of(module, layout), torch.nn.Module)
    ]


def holder_of(block, layout: families.FlatExperts):
    """The module holding the stacks, under any peft wrappers."""
    holder = getattr(block, layout.holder, None)
    while isinstance(holder, LoraFlatExperts):
        holder = holder.base_layer
    return holder if isinstance(getattr(holder, layout.gate, None), torch.Tensor) else None


def is_packed(block, layout: families.FlatExperts) -> bool:
    return hasattr(holder_of(block, layout), f"{layout.gate}_4bit")


def stack_names(layout: families.FlatExperts) -> tuple[str, str, str]:
    return (layout.gate, layout.up, layout.down)


def pack_flat_experts(model, compute_dtype: torch.dtype, quant_type: str, double_quant: bool) -> int:
    """Pack every flat expert stack of ``model`` in 4 bits (expert_stacks.pack_stack's settings) and run its
    blocks by ``flat_experts_forward``; returns how many blocks were packed."""
    found = flat_experts(model)
    for name, block, layout in found:
        holder = holder_of(block, layout)
        for stack in stack_names(layout):
            weight = getattr(holder, stack).data
            rows, remainder = divmod(weight.shape[0], block.num_experts)
            if weight.dim() != 2 or remainder:
                raise RecipeError(
                    f"model.path: {name}.{layout.holder}.{stack} has shape {tuple(weight.shape)}, not "
                    f"({block.num_experts} experts x rows, columns) as qlora_kit's families table reads it"
                )
            # (E, rows, columns): the gate's and up's rows are outputs, the down stack's inputs
            by_expert = weight.view(block.num_experts, rows, -1)
            transposed = stack == layout.down
            pack_stack(
                holder, stack, by_expert, transposed, compute_dtype, quant_type, double_quant, flat=True
            )
        block.forward = functools.partial(flat_experts_forward, block, layout)
    return len(found)


def unpack_flat_experts(model) -> int:
    """Every packed flat stack back into its 2-D parameter, and the blocks back to their own forward (the
    16-bit model merge and export write); returns the stacks unpacked."""
    unpacked = 0
    for _, block, layout in flat_experts(model):
        holder = holder_of(block, layout)
        unpacked += sum(unpack_stack(holder, stack) for stack in stack_names(layout))
        block.__dict__.pop("forward", None)  # the class's own forward again
    return unpacked


def flat_experts_forward(block, layout, hidden_states, top_k_index, top_k_weights):
    """The experts contract of transformers' mixtures ((T, H) or (B, T, H) states, (T, K) routing in, the
    states' shape out), on packed flat stacks: act(x @ gate_e.T) * (x @ up_e.T) @ down_e per expert, each
    expert on its tokens only, its routing weight applied before the down projection (it is linear)."""
    holder, lora = holder_of(block, layout), lora_factors(block, layout)
    states = hidden_states.reshape(-1, hidden_states.shape[-1])  # (T, H)
    routing = expert_matmul.route(top_k_index, block.num_experts)
    picks = routing.order[: routing.routed]
    x = states[picks // routing.top_k]  # (S, H): the picks' states in expert order
    gate = expert_matmul.looped(holder, layout.gate, x, routing, lora)
    up = expert_matmul.looped(holder, layout.up, x, routing, lora)
    weights = top_k_weights.reshape(-1)[picks].unsqueeze(1)  # (S, 1)
    h = getattr(holder, layout.activation)(gate) * up * weights.to(gate.dtype)
    y = expert_matmul.looped(holder, layout.down, h, routing, lora)  # (S, H)
    return expert_matmul.sum_over_slots(y.to(states.dtype), routing).view(hidden_states.shape)


def lora_factors(block, layout: families.FlatExperts) -> dict:
    """{stack: [(A (E, r, in), B (out, r, E), scaling)]}, expert_matmul's per-expert form, as views of the
    factors peft keeps for each 2-D stack (A (r, columns), B (E x rows, r)): the gate's and up's slice e of B
    is B_e (out, r) beside the shared A; the down stack's update of h @ W_e is (h @ B_e) @ A, so B_e.T is
    its A_e and A.T its B for every expert."""
    factors, wrapper = {}, getattr(block, layout.holder)
    while isinstance(wrapper, LoraFlatExperts):
        if wrapper.merged:
            raise RuntimeError(
                "LoraFlatExperts: merged adapters are not supported; merge into the 16-bit model"
            )
        name, experts = wrapper.parameter_name, block.num_experts
        for adapter in wrapper.active_adapters if not wrapper.disable_adapters else ():
            if adapter not in wrapper.lora_A:
                continue
            a, b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight  # (r, C), (E*R, r)
            rank = a.shape[0]
            per_expert = b.view(experts, -1, rank)  # (E, R, r)
            if name == layout.down:
                pair = (per_expert.transpose(1, 2), a.t().unsqueeze(2).expand(-1, -1, experts))
            else:
                pair = (a.unsqueeze(0).expand(experts, -1, -1), per_expert.permute(1, 2, 0))
            factors.setdefault(name, []).append((*pair, wrapper.scaling[adapter]))
        wrapper = wrapper.base_layer
    return factors


class LoraFlatExperts(ParamWrapper):
    """peft's ParamWrapper for a flat expert stack (the same parameters, shapes and saved names as plain
    peft's on the 16-bit model), reading the stack's shape through its packing; the block's forward applies
    its factors (lora_factors). Unpacked, it is peft's own (merge_and_unload)."""

    def _get_in_out_features(self, module):
        holder = self.get_base_layer()
        stats = getattr(holder, f"{self.parameter_name}_4bit", None)
        if stats is None:
            return super()._get_in_out_features(module)
        experts, out, inp = stats.shape
        rows, columns = (inp, out) if stats.transposed else (out, inp)  # as stored per expert
        self.num_experts, self._param_ndim = 1, 2  # peft's reading of a 2-D parameter
        return columns, experts * rows


# peft tells its parameter wrappers apart by class name (as for moe_experts.LoraExperts)
LoraFlatExperts.__name__ = ParamWrapper.__name__
