"""Model stage: the experts of a mixture-of-experts model in 4 bits, and LoRA on them in low-rank form.

transformers 5 stores a MoE layer's experts as two fused 3-D ``nn.Parameter``s (``gate_up_proj``: experts x
2*intermediate x hidden, ``down_proj``: experts x hidden x intermediate), not as ``nn.Linear``. bitsandbytes
quantizes only ``nn.Linear``, so a 4-bit load keeps the experts, most of the model, in 16 bits
(bitsandbytes#1849). ``quantize_experts`` (called by ``loading.load_base_model``) packs every expert with
bitsandbytes' own ``quantize_4bit`` and the recipe's quant settings, one expert at a time, and registers
``experts_forward`` with transformers' experts interface: it runs each expert the batch routes to, one at a
time, dequantizing that expert only (``bnb.matmul_4bit``, whose backward dequantizes again instead of
keeping the 16-bit weight). The router stays in the compute dtype.

LoRA on the experts is peft's own ``target_parameters`` (``ParamWrapper``, its saved format), with one
change: ``LoraExperts`` applies expert e's update as ``x @ A_e.T @ B_e.T`` to the tokens routed to e,
never materialising ``B @ A`` for the whole stack at every forward as peft's wrapper does.

Which mixtures it packs is read from the experts module, not from a list of model types: transformers'
``use_experts_implementation`` decorator states the layout as the module's attributes (``has_gate``: a fused
gate/up stack or ``up_proj`` alone; ``has_bias``; ``is_transposed``: (in, out) stacks; ``is_concatenated``:
gate/up halves or interleaved, which the module's own ``_apply_gate`` reads; ``has_post_expert_norm``), and
``experts_forward`` follows them as transformers' own grouped_mm/batched_mm do. An experts module without the
decorator (Llama 4's, LongCat-Flash's) is refused in one line naming what is missing. The families table keeps
what the module cannot say (the router's name, the config's count keys; registries/families.py).
model/experts_selfcheck.py checks the packed layout against transformers' eager forward at every load.
"""

from __future__ import annotations

import logging

import torch
from peft.tuners.lora.layer import ParamWrapper
from transformers.integrations.moe import ExpertsInterface

from qlora_kit.errors import RecipeError
from qlora_kit.model import expert_matmul, moe_flat
from qlora_kit.model.expert_stacks import pack_stack, unpack_stack
from qlora_kit.registries import families

log = logging.getLogger(__name__)

# the fused 3-D weights, as transformers names them: gate/up fused (has_gate) or up alone, then down
EXPERT_PARAMETERS = ("gate_up_proj", "up_proj", "down_proj")
# what transformers' use_experts_implementation sets on an experts module (integrations/moe.py)
DECLARED_LAYOUT = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
IMPLEMENTATION = "qlora_kit_4bit"  # our entry in transformers' ExpertsInterface


def fused_experts(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module holding fused 3-D expert weights (in any dtype): those transformers
    declares (use_experts_implementation), and those it does not whose stacks hold one matrix per routed
    expert (Llama 4's: refused by check_packable). Another module's 3-D weights (Inkling's stack of shared
    experts, run by its own bmm) are not the routed experts and stay as the model keeps them."""
    facet = families.experts_facet(model.config) if hasattr(model, "config") else None
    routed = getattr(model.config.get_text_config(), facet.count_key, None) if facet else None
    found = []
    for name, module in model.named_modules():
        stacks = stacks_of(module)
        if not stacks:
            continue
        first_dims = {
            getattr(module, stack).shape[0] for stack in stacks if not hasattr(module, f"{stack}_4bit")
        }
        if declares_layout(module) or routed is None or routed in first_dims:
            found.append((name, module))
    return found


def stacks_of(experts) -> tuple[str, ...]:
    """The fused weights an experts module holds, packed or not, input projection first."""
    return tuple(
        name
        for name in EXPERT_PARAMETERS
        if hasattr(experts, f"{name}_4bit")
        or (isinstance(getattr(experts, name, None), torch.Tensor) and getattr(experts, name).dim() == 3)
    )


def declares_layout(experts) -> bool:
    """The module went through transformers' use_experts_implementation, which states its layout."""
    return all(hasattr(experts, key) for key in DECLARED_LAYOUT) and hasattr(experts, "_apply_gate")


def layer_routers(model, layers: list[torch.nn.Module]) -> tuple[list[tuple[int, torch.nn.Module]], int]:
    """Each router of ``model`` (a base model, not peft's wrapper) with the index of its decoder layer (of
    ``layers``, the model's decoder layers in order), and the experts each routes to: [] and 0 for a dense
    model or one whose router the table does not name. A dense layer before the mixture ones (DeepSeek's
    first_k_dense_replace) has none."""
    _, facet = experts_of(model)
    if facet is None or facet.router is None or not fused_experts(model):
        return [], 0
    # a vision-language mixture (Qwen3-VL-MoE) counts its experts in its language model's config
    count = getattr(model.config.get_text_config(), facet.count_key)
    found = [
        (i, layer.get_submodule(facet.router))
        for i, layer in enumerate(layers)
        if layer_holds(layer, facet.router)
    ]
    return found, count


def layer_holds(layer: torch.nn.Module, path: str) -> bool:
    """Whether ``layer`` has the submodule at ``path`` (a dense layer of a mixture has no router or experts:
    DeepSeek's first_k_dense_replace)."""
    try:
        layer.get_submodule(path)
    except AttributeError:
        return False
    return True


def experts_of(model) -> tuple[str, families.Experts | None]:
    """The model's type and its experts facet: the families table's, else one read from the config's common
    keys (families.experts_facet); None for a dense model."""
    model_type = getattr(model.config, "model_type", "?")
    return model_type, families.experts_facet(model.config)


def quantize_experts(model, compute_dtype: torch.dtype, quant_type: str, double_quant: bool) -> int:
    """Pack every fused expert weight of ``model`` into 4 bits (``quant_type``, ``double_quant``: bitsandbytes'
    settings, as the linear layers got them) from ``compute_dtype``; returns how many experts modules were
    packed. A family whose layout is not handled is refused in one line: its experts would otherwise stay in
    16 bits, silently."""
    modules = fused_experts(model)
    if not modules:  # DBRX's undeclared flat stacks, by the families table's entry (moe_flat.py)
        return moe_flat.pack_flat_experts(model, compute_dtype, quant_type, double_quant)
    check_packable(model)
    for _, experts in modules:
        pack_experts(experts, compute_dtype, quant_type, double_quant)
    use_routed_loop(model)
    check_no_16bit_experts(model)
    return len(modules)


def check_packable(model) -> None:
    """RecipeError in one line when an experts module of ``model`` does not state its layout (transformers'
    use_experts_implementation), which packing it in 4 bits reads (loading and planning it alike)."""
    for name, experts in fused_experts(model):
        if not declares_layout(experts):
            model_type = getattr(model.config, "model_type", "?")
            raise RecipeError(
                f"model.path: {model_type} is a mixture of experts whose experts cannot be loaded in 4 bits: "
                f"{name} ({type(experts).__name__}) is not declared with transformers' use_experts_implementation, "
                f"so its layout ({', '.join(DECLARED_LAYOUT)}) and its forward through the experts interface are "
                "missing (quant.bits 16 loads it with the experts in 16 bits)"
            )


def use_routed_loop(model) -> None:
    """Run ``model``'s experts through ``experts_forward`` (packed or not: the planner traces it on 16-bit
    fake weights)."""
    ExpertsInterface.register(IMPLEMENTATION, experts_forward)
    model.set_experts_implementation(IMPLEMENTATION)


def pack_experts(experts, compute_dtype: torch.dtype, quant_type: str, double_quant: bool) -> None:
    """Pack each fused stack of one experts module in 4 bits (expert_stacks.pack_stack's settings)."""
    transposed = getattr(experts, "is_transposed", False)
    for name in stacks_of(experts):
        weight = getattr(experts, name).data
        pack_stack(experts, name, weight, transposed, compute_dtype, quant_type, double_quant)


def dequantize_experts(model) -> int:
    """Unpack every 4-bit expert stack of ``model`` back into its 3-D parameter in the compute dtype, and give
    the experts back to transformers' own implementation: the 16-bit model merge and export write (the
    counterpart of transformers' ``dequantize()``, which knows only ``Linear4bit``). Returns the stacks
    unpacked."""
    unpacked = sum(dequantize_experts_of(experts) for _, experts in fused_experts(model))
    unpacked += moe_flat.unpack_flat_experts(model)
    if unpacked and fused_experts(model):
        model.set_experts_implementation(None)  # transformers' default for the model's own code
    return unpacked


def dequantize_experts_of(experts) -> int:
    """One experts module's packed stacks back into 3-D parameters in transformers' storage layout."""
    return sum(unpack_stack(experts, name) for name in stacks_of(experts))


def compute_dtype(experts) -> torch.dtype | None:
    """The dtype a packed experts module computes in (None: not packed)."""
    stats = [getattr(experts, f"{name}_4bit", None) for name in EXPERT_PARAMETERS]
    return next((s.dtype for s in stats if s is not None), None)


def check_no_16bit_experts(model) -> None:
    """Raise when any fused expert weight is still a floating-point tensor after quantize_experts."""
    for name, experts in fused_experts(model):
        for param in EXPERT_PARAMETERS:
            tensor = getattr(experts, param, None)
            if tensor is not None and tensor.is_floating_point():
                raise RuntimeError(f"{name}.{param} is still {tensor.dtype} after 4-bit loading")


def logical_shape(experts, name: str) -> tuple[int, int, int]:
    """(experts, out, in) of a fused weight, packed or not (a transposed stack is stored (experts, in, out))."""
    stats = getattr(experts, f"{name}_4bit", None)
    if stats is not None:
        return stats.shape
    e, first, second = getattr(experts, name).shape
    return (e, second, first) if getattr(experts, "is_transposed", False) else (e, first, second)


def experts_forward(experts, hidden_states, top_k_index, top_k_weights, lora=None):
    """transformers' experts contract, (T, H) states and (T, K) routing in, (T, H) out: the picks sorted by
    expert once, each expert run on its tokens only (expert_matmul.py: a loop on the CPU, grouped matmuls
    on CUDA; ``set_matmul_path`` chooses), the routing weights applied on the narrower side of the down
    projection. ``lora``: {parameter name: [(A (E, r, in), B (out, r, E), scaling)]} from LoraExperts."""
    path = getattr(experts, "matmul_path", "auto")
    if path == "auto":
        path = "grouped" if grouped_mm_runs(hidden_states) else "looped"
    project = expert_matmul.grouped if path == "grouped" else expert_matmul.looped
    routing = expert_matmul.route(top_k_index, experts.num_experts)
    picks = routing.order[: routing.routed]
    tokens = picks // routing.top_k
    if path == "looped":  # each expert's states gathered for it
        x = expert_matmul.rows_per_expert(hidden_states, tokens, routing)
    else:  # (S, H): the picks' states in expert order
        x = hidden_states[tokens]
    # the layout transformers declares on the module (integrations/moe.py): gate and up fused, whose halves
    # (concatenated or interleaved) the module's own _apply_gate splits, or up alone and the activation
    if experts.has_gate:
        h = experts._apply_gate(project(experts, "gate_up_proj", x, routing, lora))
    else:
        h = experts.act_fn(project(experts, "up_proj", x, routing, lora))
    weights = top_k_weights.reshape(-1)[picks].unsqueeze(1)  # (S, 1): each pick's routing weight
    norm = experts.post_expert_norm if experts.has_post_expert_norm else None
    # the down projection is linear: its input weighted is its output weighted, and the narrower of the two
    # costs less (128 experts top-8: 768 values a row against 2,048); a bias must be weighted too, and a norm
    # after each expert is not linear, so not there
    weigh_first = (
        expert_matmul.bias_of(experts, "down_proj") is None
        and norm is None
        and h.shape[1] < hidden_states.shape[1]
    )
    if weigh_first:
        h = h * weights.to(h.dtype)
    if path == "looped":  # each expert's rows added into the tokens' sums as they come: no (S, H) tensor
        out = hidden_states.new_zeros(hidden_states.shape)
        for rows, y in expert_matmul.each_expert(experts, "down_proj", h, routing, lora):
            if norm is not None:
                y = norm(y)
            if not weigh_first:
                y = y * weights[rows].to(y.dtype)
            # index_put_ saves no copy of y for backward, as index_add_ would
            out.index_put_((tokens[rows],), y.to(out.dtype), accumulate=True)
        return out
    y = project(experts, "down_proj", h, routing, lora)  # (S, H)
    if norm is not None:
        y = norm(y)
    if not weigh_first:
        y = y * weights.to(y.dtype)
    return expert_matmul.sum_over_slots(y.to(hidden_states.dtype), routing)


MATMUL_PATHS = ("auto", "looped", "grouped")


def set_matmul_path(model, path: str) -> None:
    """How ``model``'s experts run their matmuls: ``auto`` (grouped where torch's grouped GEMM runs on
    CUDA, else looped), or one of the two forced (the benchmark and the tests compare them)."""
    if path not in MATMUL_PATHS:
        raise ValueError(f"matmul path must be one of {MATMUL_PATHS}, got {path!r}")
    for _, experts in fused_experts(model):
        experts.matmul_path = path


def grouped_mm_runs(x: torch.Tensor) -> bool:
    """torch's grouped GEMM has a kernel for ``x``'s device: CUDA from compute capability 8.0 (its CPU
    kernel is a loop of its own; the CPU keeps ours, which skips idle experts)."""
    grouped = hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")
    return grouped and x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 0)


class LoraExperts(ParamWrapper):
    """peft's ParamWrapper for a fused expert weight (same parameters, same saved names, same config), whose
    forward applies the update in low-rank form to the routed tokens only. The outermost wrapper of a
    nest (one per targeted parameter) runs the experts with the factors of all of them."""

    def _get_in_out_features(self, module):
        # the stack's shape as transformers stores it, not the packed one; peft reads a stack as (experts,
        # in, out) here and swaps the two for untransposed stacks in update_layer (a transposed one, gpt-oss's,
        # is (experts, in, out) already), so they go back as they are
        base = self.get_base_layer()
        self.num_experts, out_features, in_features = logical_shape(base, self.parameter_name)
        self._param_ndim = 3
        if getattr(base, "is_transposed", False):
            return in_features, out_features
        return out_features, in_features

    def forward(self, hidden_states, top_k_index, top_k_weights):
        experts, factors = self.get_base_layer(), {}
        layer = self
        while isinstance(layer, LoraExperts):
            if layer.merged:
                raise RuntimeError(
                    "LoraExperts: merged adapters are not supported; merge into the 16-bit model"
                )
            if not layer.disable_adapters:
                factors[layer.parameter_name] = [
                    layer.low_rank_factors(a) for a in layer.active_adapters if a in layer.lora_A
                ]
            layer = layer.base_layer
        return experts_forward(experts, hidden_states, top_k_index, top_k_weights, lora=factors)

    def low_rank_factors(self, adapter: str):
        """(A (E, r, in), B (out, r, E), scaling), peft's layout of the stacked factors (get_delta_weight)."""
        a = self.lora_A[adapter].weight
        b = self.lora_B[adapter].weight
        return (
            a.reshape(self.num_experts, -1, a.shape[-1]),
            b.reshape(b.shape[0], -1, self.num_experts),
            self.scaling[adapter],
        )


# peft tells its parameter wrappers apart by class name (tuners_utils.BaseTuner._inject_parameters: nesting a
# second wrapper on the same experts, or a second adapter); LoraExperts is one, under peft's name.
LoraExperts.__name__ = ParamWrapper.__name__


KINDS = ("attention", "experts", "shared experts", "router", "embeddings", "other")


def kind_of(name: str) -> str:
    """Which part of a decoder a parameter or buffer name belongs to (LoRA matrices by what they adapt)."""
    if ".experts." in name:
        return "experts"
    if "shared_expert" in name:
        return "shared experts"
    if ".mlp.gate." in name or "router" in name:
        return "router"
    if "attn" in name or "attention" in name:
        return "attention"
    if "embed" in name or "lm_head" in name or ".wte." in name or ".wpe." in name:
        return "embeddings"
    return "other"


def bytes_by_kind(model) -> dict[str, int]:
    """Bytes of the loaded model's tensors (parameters, buffers, 4-bit statistics) by kind: a 4-bit load that
    kept the experts in 16 bits shows at a glance."""
    sizes = dict.fromkeys(KINDS, 0)
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        nbytes = tensor.numel() * tensor.element_size()
        state = getattr(tensor, "quant_state", None)  # a Linear4bit's absmax lives beside its weight
        if state is not None:
            nbytes += sum(t.numel() * t.element_size() for t in _state_tensors(state))
        sizes[kind_of(name)] += nbytes
    return {kind: size for kind, size in sizes.items() if size}


def _state_tensors(state) -> list[torch.Tensor]:
    tensors = [state.absmax, state.code]
    if state.nested:
        tensors += [state.state2.absmax, state.state2.code]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def trainable_by_kind(model) -> dict[str, int]:
    """Trainable parameters by kind (attention, experts, router, shared experts, ...)."""
    counts = dict.fromkeys(KINDS, 0)
    for name, param in model.named_parameters():
        if param.requires_grad:
            counts[kind_of(name)] += param.numel()
    return counts


def describe_sizes(sizes: dict[str, int]) -> str:
    return ", ".join(f"{kind} {size / 2**20:,.2f} MiB" for kind, size in sizes.items())
