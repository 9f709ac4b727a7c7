"""Peak-memory prediction from a model config alone (no weights): ``qlora-kit plan RECIPE``.

The model is built on the meta device from its config, so every parameter's shape is exact; nothing
is downloaded but the config. Terms, for N = batch x sequence tokens, c = bytes of the compute dtype,
r = LoRA rank, L layers, V vocabulary:

Weights
- 4-bit linears: 0.5 byte per weight, plus one absmax per 64-weight block: 4 bytes (fp32), or with
  double quantization 1 byte plus a 4-byte second-level absmax per 256 blocks (and a 256-entry fp32
  code table per tensor): 4.5 or ~4.127 bits per weight.
- Left unquantized (embeddings, the output head, norms, biases): c bytes per value.
- LoRA: r x (d_in + d_out) fp32 values per adapted linear; gradients the same; AdamW state 8 bytes per
  value (32-bit) or 2 + 8/256 (8-bit: two uint8 moments and an fp32 absmax per 256-block, plus two
  1 KiB quantization maps per tensor; tensors under 4,096 values stay 32-bit).

Activations kept for backward (what autograd saves; measured on the CPU with
``accounting.SavedTensors``; the unit test holds this to +-5%):
- a checkpointed decoder layer keeps only its input: N x hidden x c;
- a kept layer: its two RMSNorms keep their fp32 input and 1/rms (N x (4 hidden + 4) each; the first
  layer's input norm keeps nothing when no input gradient is needed, i.e. without checkpointing);
  each LoRA-adapted linear keeps its input cast to fp32 (N x d_in x 4) and the A output (N x r x 4),
  and with dropout the dropout mask (N x d_in x m, m = 4 on the CPU, 1 on CUDA); attention keeps q, k,
  v and its output (N x head_dim x (2 heads + 2 kv_heads) x c) and the fp32 log-sum-exp (N x heads x 4);
  the gated MLP keeps the gate output, its activation and the up output (3 x N x intermediate x c);
  the first kept layer also holds the rotary cos/sin tables (2 x rows x T x head_dim x c);
- the head: the final norm (N x (4 hidden + 4)) and the loss: fp32 log-probabilities N x V x 4 plus the
  shifted labels (N x 8); with the chunked loss instead the trained positions' final hidden states
  (n_trained x hidden x c), their labels (n_trained x 8) and the boolean mask that selected them
  (batch x (seq - 1)), logits never kept. The planner assumes every position is trained (the worst
  case: text data or train_on_inputs); completion-only data keeps less.

Transients on top of what is kept, whichever is larger: the loss head's logits (N x V x (c + 4 + 4):
16-bit logits, their fp32 copy, log-probabilities; one chunk of tokens with the chunked loss), or the
backward pass's recompute spike: one decoder layer's full activations, rematerialised, plus the LoRA
gradients and two N x hidden x c hidden-state gradients in flight.

peak = weights + LoRA parameters + optimizer state + kept activations + max(transients).
The GPU's CUDA context and allocator fragmentation come on top and are not predicted.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from qlora_kit import hub
from qlora_kit.memory.accounting import decoder_layers
from qlora_kit.memory.optimizers import OPTIMIZERS
from qlora_kit.memory.tracing import trace_layers
from qlora_kit.model import resolve_model_path
from qlora_kit.paths import first_line
from qlora_kit.precision import Device, resolve_mixed_precision
from qlora_kit.recipe import RecipeError

if TYPE_CHECKING:
    from qlora_kit.recipe import Recipe

BUNDLED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
BLOCK = 64  # bitsandbytes' 4-bit blocksize as transformers configures it
NESTED_BLOCK = 256
GIB = 1024**3
ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj", "qkv_proj")  # the linears reading a layer's first norm


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
    quantized = [m for m in meta.modules() if _is_linear(m) and m is not head]
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
        LinearShape(name, *_features(m), m.bias is not None)
        for name, m in layer.named_modules()
        if _is_linear(m)
    ]
    text = config.get_text_config()
    heads = text.num_attention_heads
    return ModelShape(
        layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        # only the formula fallback reads it; GPT-2's config says n_inner, or nothing for 4 x hidden
        intermediate=getattr(text, "intermediate_size", None)
        or getattr(text, "n_inner", None)
        or 4 * text.hidden_size,
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


def _is_linear(module: torch.nn.Module) -> bool:
    """A linear layer bitsandbytes quantizes: nn.Linear, or GPT-2's transposed Conv1D."""
    return isinstance(module, (torch.nn.Linear, Conv1D))


def _features(module: torch.nn.Module) -> tuple[int, int]:
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.nf  # Conv1D keeps its weight as (in, out)
    return module.in_features, module.out_features


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
        fetch = (
            hub.explain(exc, "model.path", path, recipe.model.revision, "model")
            if hub.is_hub_id(path)
            else None
        )
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


@dataclass
class Activations:
    per_layer: list[int]
    head: int
    source: str = "formula"  # "traced": the layers' figures come from running the model's code (tracing.py)

    @property
    def total(self) -> int:
        return sum(self.per_layer) + self.head


def kept_layer_bytes(
    shape: ModelShape, recipe: Recipe, tokens: int, device: str, input_grad: bool = True
) -> int:
    """What one decoder layer that is not checkpointed keeps for backward (bf16/fp16 compute)."""
    c = DTYPE_BYTES[recipe.quant.compute_dtype]
    n, r = tokens, recipe.lora.rank
    norm = n * (4 * shape.hidden + 4)
    mask = 4 if device == "cpu" else 1
    lora = sum(n * li.d_in * 4 + n * r * 4 for li in targets(shape, recipe))
    if recipe.lora.dropout > 0:
        # Dropout keeps its mask only where its input needs a gradient: not for the attention input
        # projections of a first layer whose input needs none.
        lora += sum(
            n * li.d_in * mask
            for li in targets(shape, recipe)
            if input_grad or li.name.split(".")[-1] not in ATTENTION_INPUTS
        )
    attention = n * shape.head_dim * (2 * shape.heads + 2 * shape.kv_heads) * c + n * shape.heads * 4
    mlp = 3 * n * shape.intermediate * c
    return (2 if input_grad else 1) * norm + lora + attention + mlp


def checkpointed(policy: str, every_n: int, layers: int) -> list[bool]:
    if policy == "none":
        return [False] * layers
    step = 1 if policy == "full" else every_n
    return [i % step == 0 for i in range(layers)]


def activation_bytes(
    shape: ModelShape,
    recipe: Recipe,
    policy: str,
    every_n: int,
    batch: int,
    seq: int,
    device: str = "cpu",
    trained_tokens: int | None = None,
    precision: str = "no",
) -> Activations:
    """Bytes kept for backward at ``batch`` x ``seq`` under a checkpointing policy and the Trainer's
    autocast ``precision``: traced from the model's own code where it runs on fake tensors, else from
    the Llama-shaped formula (which assumes no autocast)."""
    flags = checkpointed(policy, every_n, shape.layers)
    traced = trace_layers(shape.config, recipe, batch, seq, precision) if shape.config is not None else None
    if traced is None:
        return formula_activation_bytes(shape, recipe, policy, every_n, batch, seq, device, trained_tokens)
    per_layer = traced.per_layer(flags)
    if device != "cpu" and recipe.lora.dropout > 0:
        # The trace ran the CPU's dropout, whose masks keep 4 bytes a value; CUDA's keep 1.
        n = batch * seq
        for i, is_checkpointed in enumerate(flags):
            if not is_checkpointed:
                grad = policy != "none" or i > 0
                per_layer[i] -= kept_layer_bytes(shape, recipe, n, "cpu", grad) - kept_layer_bytes(
                    shape, recipe, n, device, grad
                )
    if recipe.memory.chunked_loss:  # which positions it keeps depends on the labels' values: closed form
        head = head_bytes(shape, recipe, batch, seq, trained_tokens)
    else:
        head = traced.head_checkpointed if any(flags) else traced.head
    return Activations(per_layer, head, source="traced")


def formula_activation_bytes(
    shape: ModelShape,
    recipe: Recipe,
    policy: str,
    every_n: int,
    batch: int,
    seq: int,
    device: str = "cpu",
    trained_tokens: int | None = None,
) -> Activations:
    """The closed form, for a Llama-shaped layer (the module docstring's terms)."""
    c = DTYPE_BYTES[recipe.quant.compute_dtype]
    n = batch * seq
    flags = checkpointed(policy, every_n, shape.layers)
    rope_rows = batch if recipe.data.packing else 1  # packed rows carry their own position ids
    per_layer, rope_counted = [], False
    for i, is_checkpointed in enumerate(flags):
        if is_checkpointed:
            per_layer.append(n * shape.hidden * c)
            continue
        kept = kept_layer_bytes(shape, recipe, n, device, input_grad=policy != "none" or i > 0)
        if not rope_counted:
            kept += 2 * rope_rows * seq * shape.head_dim * c
            rope_counted = True
        per_layer.append(kept)
    return Activations(per_layer, head_bytes(shape, recipe, batch, seq, trained_tokens))


def head_bytes(
    shape: ModelShape, recipe: Recipe, batch: int, seq: int, trained_tokens: int | None = None
) -> int:
    """What the final norm and the loss keep for backward; ``trained_tokens`` defaults to every position."""
    c = DTYPE_BYTES[recipe.quant.compute_dtype]
    tokens = batch * seq
    norm = tokens * (4 * shape.hidden + 4)
    if recipe.memory.chunked_loss:
        trained = batch * (seq - 1) if trained_tokens is None else trained_tokens
        # the trained positions' hidden states and labels, and the mask that selected them
        return norm + trained * (shape.hidden * c + 8) + batch * (seq - 1)
    return norm + tokens * shape.vocab * 4 + tokens * 8 + 4


def loss_spike(shape: ModelShape, recipe: Recipe, tokens: int) -> int:
    c = DTYPE_BYTES[recipe.quant.compute_dtype]
    rows = min(tokens, recipe.memory.loss_chunk_tokens) if recipe.memory.chunked_loss else tokens
    return rows * shape.vocab * (c + 4 + 4)


@dataclass
class PolicyPlan:
    policy: str  # "none", "full", "every_n=2", ...
    activations: int
    spike: int
    peak: int
    recompute_layers: int


@dataclass
class Plan:
    shape: ModelShape
    weights: Weights
    optimizer_state: int
    optimizer_pageable: int
    batch: int
    seq: int
    precision: str = "no"  # the Trainer's autocast the activations were traced under
    activation_source: str = "formula"  # or "traced"
    policies: list[PolicyPlan] = field(default_factory=list)

    @property
    def lora_grads(self) -> int:
        """LoRA gradients (fp32, one per parameter) exist during backward."""
        return self.weights.lora

    def chosen(self, recipe: Recipe) -> PolicyPlan:
        return next(
            p
            for p in self.policies
            if p.policy == policy_name(recipe.memory.checkpointing, recipe.memory.every_n)
        )

    def fitting(self, budget_gb: float) -> list[PolicyPlan]:
        return [p for p in self.policies if p.peak <= budget_gb * GIB]


def policy_name(policy: str, every_n: int) -> str:
    return f"every_n={every_n}" if policy == "every_n" else policy


def candidate_policies(layers: int) -> list[tuple[str, int]]:
    """From the least recompute to the most: none, every L-th layer ... every 2nd, full."""
    spaced = sorted({n for n in range(2, layers + 1)}, reverse=True)
    # Keep the every_n values that checkpoint a different number of layers.
    seen, every = set(), []
    for n in spaced:
        count = math.ceil(layers / n)
        if count not in seen:
            seen.add(count)
            every.append(("every_n", n))
    return [("none", 0), *every, ("full", 1)]


def plan(recipe: Recipe, batch: int | None = None, seq: int | None = None, device: str = "cuda") -> Plan:
    """Predict memory for every checkpointing policy at the recipe's (or the given) batch x sequence."""
    shape = model_shape(recipe)
    batch = batch or recipe.train.micro_batch_size
    seq = seq or recipe.data.max_seq_len
    weights = weight_bytes(shape, recipe)
    per_tensor = [recipe.lora.rank * d for li in targets(shape, recipe) for d in (li.d_in, li.d_out)]
    per_tensor *= shape.layers
    optimizer = OPTIMIZERS[recipe.optimizer.name]
    state = sum(optimizer.state_bytes(v) for v in per_tensor)
    pageable = sum(optimizer.state_bytes(v) for v in per_tensor if optimizer.pageable(v))
    # what the Trainer's autocast will be on that device (a GPU: quant.compute_dtype's, by default)
    precision = resolve_mixed_precision(recipe, Device(cuda=device == "cuda", bf16=True))
    result = Plan(shape, weights, state, pageable, batch, seq, precision)
    # the largest layer's full activations: what backward rematerialises for a checkpointed layer
    uncheckpointed = activation_bytes(shape, recipe, "none", 0, batch, seq, device, precision=precision)
    result.activation_source = uncheckpointed.source
    wanted = candidate_policies(shape.layers)
    own = (recipe.memory.checkpointing, 1 if recipe.memory.checkpointing == "full" else recipe.memory.every_n)
    if recipe.memory.checkpointing in ("none", "full"):
        own = (recipe.memory.checkpointing, 0 if own[0] == "none" else 1)
    if own[0] != "auto" and policy_name(*own) not in {policy_name(*w) for w in wanted}:
        wanted.append(own)  # the recipe's own every_n, when another n checkpoints as many layers
    for policy, every_n in wanted:
        result.policies.append(
            _policy_plan(shape, recipe, result, policy, every_n, device, max(uncheckpointed.per_layer))
        )
    return result


def _policy_plan(
    shape: ModelShape,
    recipe: Recipe,
    the_plan: Plan,
    policy: str,
    every_n: int,
    device: str,
    layer_bytes: int,
) -> PolicyPlan:
    batch, seq = the_plan.batch, the_plan.seq
    n = batch * seq
    acts = activation_bytes(shape, recipe, policy, every_n, batch, seq, device, precision=the_plan.precision)
    flags = checkpointed(policy, every_n, shape.layers)
    # Backward holds the LoRA gradients and two hidden-state gradients in flight, plus, when a layer
    # was checkpointed, that layer's activations rematerialised.
    backward = the_plan.lora_grads + 2 * n * shape.hidden * DTYPE_BYTES[recipe.quant.compute_dtype]
    if any(flags):
        backward += layer_bytes
    spike = max(loss_spike(shape, recipe, n), backward)
    static = the_plan.weights.total + the_plan.optimizer_state
    return PolicyPlan(
        policy_name(policy, every_n), acts.total, spike, static + acts.total + spike, sum(flags)
    )


def choose_policy(recipe: Recipe, budget_gb: float, the_plan: Plan | None = None) -> tuple[str, int, str]:
    """(policy, every_n, why) for ``memory.checkpointing: auto``: the least recompute that fits the budget."""
    the_plan = the_plan or plan(recipe)
    fits = the_plan.fitting(budget_gb)
    if not fits:
        tightest = the_plan.policies[-1]
        return (
            "full",
            1,
            (
                f"nothing fits {budget_gb:g} GiB (full checkpointing needs {tightest.peak / GIB:.2f} GiB); using full"
            ),
        )
    best = fits[0]
    policy, _, n = best.policy.partition("=")
    why = f"predicted peak {best.peak / GIB:.2f} GiB <= budget {budget_gb:g} GiB with {best.recompute_layers} of {the_plan.shape.layers} layers recomputed"
    if best is not the_plan.policies[0]:
        why += f"; none would need {the_plan.policies[0].peak / GIB:.2f} GiB"
    return policy, int(n) if n else 2, why
