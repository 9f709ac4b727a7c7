"""Shapes and weight bytes from a model's config alone: the planner's closed-form half.

The model is built on the meta device from its config (a local folder's, a bundled copy for the
shipped recipes' hub models so they plan offline, or the hub's config.json), so every parameter's shape
is exact and nothing is read but the config. Weight terms:

- 4-bit linears: 0.5 byte per weight, plus one absmax per 64-weight block: 4 bytes (fp32), or with
  double quantization 1 byte plus a 4-byte second-level absmax per 256 blocks (and a 256-entry fp32
  code table per tensor): 4.5 or ~4.127 bits per weight.
- Left unquantized (embeddings, the output head, norms, biases): c bytes per value.
- LoRA: r x (d_in + d_out) fp32 values per adapted linear.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from qlora_kit.errors import RecipeError
from qlora_kit.memory.accounting import decoder_layers
from qlora_kit.model import hub
from qlora_kit.model.layers import features, is_linear
from qlora_kit.model.loading import resolve_model_path
from qlora_kit.model.paths import first_line
from qlora_kit.registries import families

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
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    linears: list[LinearShape]  # of one decoder layer
    unquantized_values: int  # embeddings, head, norms, biases
    quantized_values: int
    quantized_tensors: int
    config: Any = None  # the transformers config, for tracing


def model_shape(recipe: Recipe) -> ModelShape:
    """Shapes from the config, through a model built on the meta device (no weights are read)."""
    config = load_config(recipe)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, trust_remote_code=recipe.model.trust_remote_code)
    head = meta.get_output_embeddings()
    quantized = [m for m in meta.modules() if is_linear(m) and m is not head]
    counted: set[int] = set()
    unquantized = 0
    for module in meta.modules():
        for param in module.parameters(recurse=False):
            if id(param) in counted:
                continue  # tied embeddings count once
            counted.add(id(param))
            if not (module in quantized and param is module.weight):
                unquantized += param.numel()
    layer = decoder_layers(meta)[0]
    linears = [
        LinearShape(name, *features(m), m.bias is not None)
        for name, m in layer.named_modules()
        if is_linear(m)
    ]
    text = config.get_text_config()
    heads = text.num_attention_heads
    return ModelShape(
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        intermediate=intermediate_size(text),
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab=text.vocab_size,
        linears=linears,
        unquantized_values=unquantized,
        quantized_values=sum(m.weight.numel() for m in quantized),
        quantized_tensors=len(quantized),
        config=config,
    )


def intermediate_size(text) -> int:
    """The MLP's width, under the family's key (GPT-2's n_inner; nothing there: 4 x hidden). Only the
    formula fallback reads it."""
    entry = families.family(getattr(text, "model_type", ""))
    keys = (entry.intermediate_key,) if entry else ("intermediate_size", "n_inner")
    return next((v for v in (getattr(text, k, None) for k in keys) if v), 4 * text.hidden_size)


def load_config(recipe: Recipe):
    """The model's config: a local folder's, a bundled copy for the shipped recipes' hub models (so they
    plan offline), or the hub's (its config.json only)."""
    path = resolve_model_path(recipe.model)
    bundled = BUNDLED_CONFIGS / (path.replace("/", "--") + ".json")
    if not Path(path).exists() and bundled.is_file():
        values = json.loads(bundled.read_text())
        return AutoConfig.for_model(values.pop("model_type"), **values)
    if hub.is_hub_id(path):
        hub.check_config(recipe.model)
    try:
        return AutoConfig.from_pretrained(
            path, trust_remote_code=recipe.model.trust_remote_code, revision=recipe.model.revision
        )
    except (OSError, ValueError) as exc:
        fetch = hub.explain_model_failure(exc, "model.path", path, recipe.model.revision)
        raise RecipeError(
            fetch or f"model.path: cannot read the config of {path} ({first_line(exc)})"
        ) from None


@dataclass
class Weights:
    quantized: int
    unquantized: int
    lora: int
    lora_values: int

    @property
    def total(self) -> int:
        return self.quantized + self.unquantized + self.lora


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
    lora_values = shape.layers * sum(recipe.lora.rank * (li.d_in + li.d_out) for li in targets(shape, recipe))
    return Weights(quantized, shape.unquantized_values * c, lora_values * 4, lora_values)


def targets(shape: ModelShape, recipe: Recipe) -> list[LinearShape]:
    """The decoder-layer linears that get adapters (all-linear: all of them; the head is not in a layer)."""
    wanted = recipe.lora.target_modules
    if wanted == "all-linear":
        return list(shape.linears)
    return [li for li in shape.linears if li.name.split(".")[-1] in wanted or li.name in wanted]
