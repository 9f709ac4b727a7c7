"""The planner's closed forms: the Llama-shaped formula a model whose code cannot run on fake tensors is
planned with (``planner``'s docstring lists its terms), the loss head's terms that tracing cannot see
(which positions the chunked head keeps depends on the labels' values, and the logits' transient), and
GRPO's rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qlora_kit.memory.loss_head import uses_chunked_loss
from qlora_kit.memory.shapes import DTYPE_BYTES, ModelShape, targets
from qlora_kit.registries import checkpointing as table
from qlora_kit.registries import families

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

# the linears reading a layer's first norm, for a family the table (registries/families.py) does not list
ATTENTION_INPUTS = ("q_proj", "k_proj", "v_proj", "qkv_proj")


@dataclass
class Activations:
    per_layer: list[int]
    head: int
    source: str = "formula"  # "traced": the layers' figures come from running the model's code (tracing.py)
    head_source: str = "closed form"  # how the head's figure was found (plan's "from" column)
    recompute_cost: list[float] = field(default_factory=list)  # per layer, what backward recomputes
    kernels: tuple[str, ...] = ()  # traced: the attention kernels the trace ran (device_kernels.py)

    @property
    def total(self) -> int:
        return sum(self.per_layer) + self.head


def kept_layer_bytes(
    shape: ModelShape,
    recipe: Recipe,
    tokens: int,
    device: str,
    input_grad: bool = True,
    mlp_tiled: bool = False,
) -> int:
    """What one decoder layer that is not checkpointed keeps for backward (bf16/fp16 compute); with
    ``mlp_tiled`` (memory.mlp_tiles > 1) its MLP keeps only its input (``tiled_mlp._KeepInput``): none of
    the MLP's LoRA inputs, dropout masks or intermediates."""
    c = DTYPE_BYTES[recipe.quant.compute_dtype]
    n, r = tokens, recipe.lora.rank
    norm = n * (4 * shape.hidden + 4)
    mask = 4 if device == "cpu" else 1
    adapted = [li for li in targets(shape, recipe) if not (mlp_tiled and in_mlp(li.name))]
    lora = sum(n * li.d_in * 4 + n * r * 4 for li in adapted)
    if lora_dropout(shape, recipe) > 0:
        # Dropout keeps its mask only where its input needs a gradient: not for the attention input
        # projections of a first layer whose input needs none.
        lora += sum(
            n * li.d_in * mask for li in adapted if input_grad or not is_attention_input(shape, li.name)
        )
    attention = n * shape.head_dim * (2 * shape.heads + 2 * shape.kv_heads) * c + n * shape.heads * 4
    mlp = n * shape.hidden * c if mlp_tiled else mlp_tensors(shape) * n * shape.intermediate * c
    return (2 if input_grad else 1) * norm + lora + attention + mlp


def in_mlp(name: str) -> bool:
    """Whether linear ``name`` of a decoder layer is inside its ``mlp`` module (what memory.mlp_tiles tiles)."""
    return name.startswith("mlp.")


def lora_dropout(shape: ModelShape, recipe: Recipe) -> float:
    """lora.dropout as the run resolves it for this model (auto: none on a mixture whose experts get LoRA)."""
    entry = _family(shape)
    return recipe.lora.dropout_for(bool(entry and entry.experts) and recipe.lora.experts)


def _family(shape: ModelShape):
    return families.family(getattr(shape.config, "model_type", ""))


def is_attention_input(shape: ModelShape, name: str) -> bool:
    """Whether linear ``name`` of a decoder layer reads the layer's first norm (the family's facet)."""
    entry = _family(shape)
    return name in entry.attention_inputs if entry else name.split(".")[-1] in ATTENTION_INPUTS


def _plain_mlp(shape: ModelShape) -> bool:
    entry = _family(shape)
    return entry is not None and entry.mlp == families.PLAIN  # unlisted families are taken as gated


def mlp_tensors(shape: ModelShape) -> int:
    """Intermediate-wide tensors an MLP keeps for backward: gate, up and the activation's output (3); a
    plain MLP its up projection's output, which the activation needs (1). The down projection's input is
    LoRA's, counted with LoRA."""
    return 1 if _plain_mlp(shape) else 3


def mlp_outputs(shape: ModelShape) -> int:
    """The MLP's 4-bit linear outputs a selective layer keeps: gate and up (2), or a plain MLP's up (1)."""
    return 1 if _plain_mlp(shape) else 2


def formula_activation_bytes(
    shape: ModelShape,
    recipe: Recipe,
    policies: list[str],
    batch: int,
    seq: int,
    device: str = "cpu",
    trained_tokens: int | None = None,
) -> Activations:
    """The closed form, for a Llama-shaped layer (the module docstring's terms)."""
    c = DTYPE_BYTES[recipe.quant.compute_dtype]
    n = batch * seq
    recomputing = any(table.recomputes(p) for p in policies)
    rope_rows = batch if recipe.data.packs else 1  # packed rows carry their own position ids
    per_layer, rope_counted = [], False
    for i, layer_policy in enumerate(policies):
        if table.recomputes(layer_policy):
            # its input; selective adds the 4-bit linears' outputs, attention's output and log-sum-exp
            # and LoRA's A outputs
            q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
            wide = mlp_outputs(shape) * shape.intermediate
            kept = n * c * (2 * q + 2 * kv + 2 * shape.hidden + wide) + n * shape.heads * 4
            kept += sum(n * recipe.lora.rank * c for _ in targets(shape, recipe))
            per_layer.append(
                n * shape.hidden * c
                + (kept if table.policy(layer_policy).keeps == table.KEEPS_EXPENSIVE else 0)
            )
            continue
        kept = kept_layer_bytes(shape, recipe, n, device, input_grad=recomputing or i > 0)
        if not rope_counted:
            kept += 2 * rope_rows * seq * shape.head_dim * c
            rope_counted = True
        per_layer.append(kept)
    # recompute cost untraced: each layer's recompute_share of a full layer's (registries/checkpointing.py)
    cost = [table.policy(p).recompute_share for p in policies]
    return Activations(per_layer, head_bytes(shape, recipe, batch, seq, trained_tokens), recompute_cost=cost)


def head_bytes(
    shape: ModelShape, recipe: Recipe, batch: int, seq: int, trained_tokens: int | None = None
) -> int:
    """What the final norm and the loss keep for backward; ``trained_tokens`` defaults to every position."""
    tokens = batch * seq
    norm = tokens * (4 * shape.hidden + 4)
    if chunked_head(shape, recipe):
        return norm + selected_positions_bytes(shape, recipe, batch, seq, trained_tokens)
    return norm + tokens * shape.vocab * 4 + tokens * 8 + 4


def chunked_head(shape: ModelShape, recipe: Recipe) -> bool:
    """Whether the run trains with the chunked loss head (a model whose config is unknown is assumed
    to have a plain head)."""
    return recipe.memory.chunked_loss if shape.config is None else uses_chunked_loss(recipe, shape.config)


def selected_positions_bytes(
    shape: ModelShape, recipe: Recipe, batch: int, seq: int, trained_tokens: int | None = None
) -> int:
    """What the chunked loss head keeps beyond the forward pass (``loss_head.chunked_lm_loss``): the
    trained positions' final hidden states and labels, and the boolean mask that selected them."""
    c = DTYPE_BYTES[recipe.quant.compute_dtype]
    trained = batch * (seq - 1) if trained_tokens is None else trained_tokens
    return trained * (shape.hidden * c + 8) + batch * (seq - 1)


def loss_spike(shape: ModelShape, recipe: Recipe, tokens: int) -> int:
    """The loss head's transient, at its backward (measured on an H200, benchmarks/results/
    planner-h200-2026-12-04.md: the backward's peak, not the forward's). The chunked head recomputes one
    chunk's logits there: its float32 log-probabilities, their gradient and the logits' float32 gradient
    are alive at once (12 bytes a logit; the 16-bit logits and their fp32 copy are freed as each is
    consumed). transformers' head keeps its log-probabilities for backward (counted as kept), and
    backward adds the two float32 gradients (8 bytes a logit) over every token."""
    rows = min(tokens, recipe.memory.loss_chunk_tokens) if chunked_head(shape, recipe) else tokens
    per_logit = 4 + 4 + 4 if chunked_head(shape, recipe) else 4 + 4
    return rows * shape.vocab * per_logit


def gradient_working_set(
    shape: ModelShape, recipe: Recipe, tokens: int, tile_tokens: int | None = None
) -> int:
    """What a decoder layer's backward holds in flight at its widest LoRA-adapted linear (the MLP's down
    projection): the input's gradient along the 4-bit path and along LoRA's (compute dtype each), and
    LoRA's two float32 copies of it (its cast of the input to float32, and the dropout's gradient)."""
    c = DTYPE_BYTES[recipe.quant.compute_dtype]
    if tile_tokens is None:
        widest = tokens * max((li.d_in for li in targets(shape, recipe)), default=shape.hidden)
    else:  # the tiled MLP's linears run one tile of tokens at a time (tiled_mlp._TileRun.gradients)
        widest = max(
            [(tile_tokens if in_mlp(li.name) else tokens) * li.d_in for li in targets(shape, recipe)],
            default=tokens * shape.hidden,
        )
    # an RMSNorm computed in float32 by autograd's ops (x.float(), pow, mean, rsqrt, mul: Llama's and its
    # like): its backward holds five float32 tokens x hidden tensors at once (the product's gradient, the
    # mean's expanded gradient, and pow's backward: x ** 1, 2 x and the gradient times it)
    norm = tokens * shape.hidden * 5 * 4
    return max(widest * (2 * c + 2 * 4), norm)


def rollout_bytes(shape: ModelShape, recipe: Recipe) -> int:
    """GRPO's sampling: the KV cache of one generation batch and its last logits (``planner``'s docstring)."""
    sequences = recipe.train.micro_batch_size * recipe.train.grad_accum
    c = DTYPE_BYTES[recipe.quant.compute_dtype]
    cache = 2 * shape.layers * shape.kv_heads * shape.head_dim * recipe.data.max_seq_len * sequences * c
    return cache + sequences * shape.vocab * 8
