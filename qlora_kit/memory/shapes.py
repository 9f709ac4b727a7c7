"""Shapes and weight bytes from a model's config alone: the planner's closed-form half.

The model is built on the meta device from its config (a local folder's, a bundled copy for the
shipped recipes' hub models so they plan offline, or the hub's config.json), so every parameter's shape
is exact and nothing is read but the config. Weight terms:

- 4-bit linears: 0.5 byte per weight, plus one absmax per 64-weight block: 4 bytes (fp32), or with
  double quantization 1 byte plus a 4-byte second-level absmax per 256 blocks (and a 256-entry fp32
  code table per tensor): 4.5 or ~4.127 bits per weight.
- Left unquantized (embeddings, the output head, norms, biases): c bytes per value.
- LoRA: r x (d_in + d_out) fp32 values per adapted linear.
- A mixture of experts' fused 3-D expert stacks (``ExpertStack``), packed one expert at a time by
  ``moe_experts.py``: 0.5 byte per weight, per expert one absmax per 64-weight block (1 byte with double
  quantization, plus a 4-byte second-level absmax per 256 blocks and a 4-byte offset; 4 bytes without),
  and per stack the code tables (16 fp32 values, and 256 with double quantization). LoRA on a stack:
  r x (d_in + d_out) fp32 values per expert.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig

from qlora_kit.errors import RecipeError
from qlora_kit.memory.accounting import decoder_layers
from qlora_kit.model import hub, layer_sizes, moe_experts, text_only, vision
from qlora_kit.model.layers import features, is_linear
from qlora_kit.model.loading import (
    check_checkpointable,
    check_has_attention,
    check_loadable_in_4_bits,
    resolve_model_path,
)
from qlora_kit.model.paths import first_line
from qlora_kit.registries import attention, families

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

BUNDLED_CONFIGS = Path(__file__).resolve().parents[1] / "model" / "configs"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
BLOCK = 64  # bitsandbytes' 4-bit blocksize as transformers configures it
NESTED_BLOCK = 256


@dataclass
class LinearShape:
    name: str  # e.g. "self_attn.q_proj"
    d_in: int
    d_out: int
    bias: bool


@dataclass
class ExpertStack:
    """One fused 3-D expert weight (``gate_up_proj`` or ``down_proj`` of one layer's experts)."""

    name: str  # e.g. "model.layers.0.mlp.experts.gate_up_proj"
    experts: int
    d_out: int
    d_in: int
    active: int  # experts each token is routed to

    @property
    def values(self) -> int:
        return self.experts * self.d_out * self.d_in


@dataclass
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    linears: list[LinearShape]  # of the first decoder layer (the formula fallback's)
    unquantized_values: int  # embeddings, head, norms, biases
    quantized_values: int
    quantized_tensors: int
    config: Any = None  # the transformers config, for tracing
    expert_stacks: list[ExpertStack] = field(default_factory=list)  # of the whole model (a MoE's)
    # of every decoder layer: layers differ (hybrid attention, Gemma 4's head sizes and shared keys/values)
    layer_linears: list[list[LinearShape]] = field(default_factory=list)

    @property
    def expert_values(self) -> int:
        return sum(stack.values for stack in self.expert_stacks)

    @property
    def active_expert_values(self) -> int:
        """The expert weights one token runs through."""
        return sum(stack.values * stack.active // stack.experts for stack in self.expert_stacks)


def model_shape(recipe: Recipe) -> ModelShape:
    """Shapes from the config, through a model built on the meta device (no weights are read)."""
    config = load_config(recipe)
    layer_sizes.check_layers_counted(config)  # as loading it would be
    check_has_attention(config)
    check_loadable_in_4_bits(config, recipe.quant)
    with torch.device("meta"):
        meta = vision.auto_class(config).from_config(config, trust_remote_code=recipe.model.trust_remote_code)
    check_checkpointable(meta)
    head = meta.get_output_embeddings()
    # a vision-language model's vision tower and projector stay in 16 bits unless quant.vision (vision.py)
    kept = None if recipe.quant.vision else vision.vision_of(config)
    quantized = [
        m
        for name, m in meta.named_modules()
        if is_linear(m) and m is not head and not vision.on_vision_side(name, kept)
    ]
    stacks = expert_stacks(meta, config)
    if stacks and recipe.quant.bits == 4:
        moe_experts.check_packable(meta)  # as loading it would be
    try:  # a kernel that cannot run the model's attention sinks is refused as loading refuses it
        attention.check_sinks(recipe.model.attn_implementation, config.get_text_config())
    except ValueError as exc:
        raise RecipeError(str(exc)) from None
    counted: set[int] = {  # the stacks (their biases, gpt-oss's, stay in 16 bits: counted below)
        id(getattr(experts, name))
        for _, experts in moe_experts.fused_experts(meta)
        for name in moe_experts.EXPERT_PARAMETERS
        if getattr(experts, name, None) is not None
    }
    unquantized = 0
    for module in meta.modules():
        for param in module.parameters(recurse=False):
            if id(param) in counted:
                continue  # tied embeddings count once
            counted.add(id(param))
            if not (module in quantized and param is module.weight):
                unquantized += param.numel()
    layer_linears = [
        [
            LinearShape(name, *features(m), m.bias is not None)
            for name, m in layer.named_modules()
            if is_linear(m)
        ]
        for layer in decoder_layers(meta)
    ]
    text = config.get_text_config()
    return ModelShape(
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        intermediate=intermediate_size(text),
        heads=text.num_attention_heads,
        # the formula fallback's Llama-shaped layer, at the widest layer's (Gemma 4's full-attention layers)
        kv_heads=max(layer_sizes.kv_heads(text)),
        head_dim=max(layer_sizes.head_dims(text)),
        vocab=text.vocab_size,
        linears=layer_linears[0],
        layer_linears=layer_linears,
        unquantized_values=unquantized,
        quantized_values=sum(m.weight.numel() for m in quantized),
        quantized_tensors=len(quantized),
        config=config,
        expert_stacks=stacks,
    )


def expert_stacks(meta, config) -> list[ExpertStack]:
    """The fused expert weights of a model built from ``config`` (none for a dense model)."""
    text, facet = config.get_text_config(), families.experts_facet(config)
    active = getattr(text, facet.active_key, 1) if facet else 1
    return [
        ExpertStack(f"{name}.{param}", *moe_experts.logical_shape(experts, param), active)
        for name, experts in moe_experts.fused_experts(meta)
        for param in moe_experts.EXPERT_PARAMETERS
        if getattr(experts, param, None) is not None
    ]


def intermediate_size(text) -> int:
    """The MLP's width, under the family's key (GPT-2's n_inner; nothing there: 4 x hidden). Only the
    formula fallback reads it."""
    entry = families.family(getattr(text, "model_type", ""))
    keys = (entry.intermediate_key,) if entry else ("intermediate_size", "n_inner")
    return next((v for v in (getattr(text, k, None) for k in keys) if v), 4 * text.hidden_size)


def load_config(recipe: Recipe):
    """The config of the model qlora_kit builds (a multimodal checkpoint's language model alone: its text
    config, model/text_only.py): a local folder's, a bundled copy for the shipped recipes' hub models (so
    they plan offline), or the hub's (its config.json only)."""
    path = resolve_model_path(recipe.model)
    bundled = BUNDLED_CONFIGS / (path.replace("/", "--") + ".json")
    if not Path(path).exists() and bundled.is_file():
        values = json.loads(bundled.read_text())
        return text_only.language_model_config(AutoConfig.for_model(values.pop("model_type"), **values))
    if hub.is_hub_id(path):
        hub.check_config(recipe.model)
    try:
        config = AutoConfig.from_pretrained(
            path, trust_remote_code=recipe.model.trust_remote_code, revision=recipe.model.revision
        )
    except (OSError, ValueError) as exc:
        fetch = hub.explain_model_failure(exc, "model.path", path, recipe.model.revision)
        raise RecipeError(
            fetch or f"model.path: cannot read the config of {path} ({first_line(exc)})"
        ) from None
    return text_only.language_model_config(config)


@dataclass
class Weights:
    quantized: int  # the decoder's linears
    unquantized: int
    lora: int
    lora_values: int
    experts: int = 0  # a mixture of experts' fused stacks, in 4 bits (or 16 with quant.bits 16)

    @property
    def total(self) -> int:
        return self.quantized + self.unquantized + self.lora + self.experts


def lora_tensor_values(shape: ModelShape, recipe: Recipe) -> list[int]:
    """Each LoRA tensor's values, one entry a tensor (the optimizer keeps state per tensor): A (r x in) and
    B (out x r) of every targeted linear, and with ``lora.experts`` each expert stack's stacked pair
    (peft's target_parameters: A is experts * r x in, B out x experts * r)."""
    r = recipe.lora.rank
    values = [r * d for li in every_layers_targets(shape, recipe) for d in (li.d_in, li.d_out)]
    if recipe.lora.experts:
        values += [stack.experts * r * d for stack in shape.expert_stacks for d in (stack.d_in, stack.d_out)]
    return values


def weight_bytes(shape: ModelShape, recipe: Recipe) -> Weights:
    c = DTYPE_BYTES[recipe.quant.compute_dtype]
    blocks = math.ceil(shape.quantized_values / BLOCK)
    if recipe.quant.double_quant:
        constants = (
            blocks * 1
            + math.ceil(blocks / NESTED_BLOCK) * 4
            + shape.quantized_tensors * (NESTED_BLOCK * 4 + 4)
        )
    else:
        constants = blocks * 4
    quantized = math.ceil(shape.quantized_values / 2) + constants
    if recipe.quant.bits == 16:
        quantized = shape.quantized_values * c
    lora_values = sum(lora_tensor_values(shape, recipe))
    experts = sum(stack_bytes(s, recipe) for s in shape.expert_stacks)
    return Weights(quantized, shape.unquantized_values * c, lora_values * 4, lora_values, experts)


def stack_bytes(stack: ExpertStack, recipe: Recipe) -> int:
    """One fused expert stack as ``moe_experts`` packs it (each expert quantized on its own)."""
    if recipe.quant.bits == 16:
        return stack.values * DTYPE_BYTES[recipe.quant.compute_dtype]
    blocks = math.ceil(stack.d_out * stack.d_in / BLOCK)  # per expert
    code = 16 * 4  # the NF4/FP4 code table
    if recipe.quant.double_quant:
        per_expert = blocks + math.ceil(blocks / NESTED_BLOCK) * 4 + 4
        code += NESTED_BLOCK * 4
    else:
        per_expert = blocks * 4
    return stack.experts * (math.ceil(stack.d_out * stack.d_in / 2) + per_expert) + code


def targets(shape: ModelShape, recipe: Recipe, linears: list[LinearShape] | None = None) -> list[LinearShape]:
    """The linears of a decoder layer (the first's by default) that get adapters (all-linear: all of them;
    the head is not in a layer)."""
    linears = shape.linears if linears is None else linears
    wanted = recipe.lora.target_modules
    if wanted == "all-linear":
        return list(linears)
    return [li for li in linears if li.name.split(".")[-1] in wanted or li.name in wanted]


def every_layers_targets(shape: ModelShape, recipe: Recipe) -> list[LinearShape]:
    """The linears that get adapters in every decoder layer (the first's, once a layer, where the shape
    was made without the others)."""
    layers = shape.layer_linears or [shape.linears] * shape.layers
    return [li for linears in layers for li in targets(shape, recipe, linears)]
