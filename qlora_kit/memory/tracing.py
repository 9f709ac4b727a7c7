"""The planner's activation terms, traced: the model's own code run on tensors that hold no memory.

What autograd keeps for backward depends on everything a formula would have to guess per architecture:
the norms (and q/k norms, post-norms), a gated or plain MLP, fused or separate projections, parallel
residuals, the attention kernel and its mask, soft-capping. Here it is measured the way the run
measures it (``accounting.SavedTensors``, ``saved_tensors_hooks``), on a model that costs nothing:

1. the config is cut to a few layers: the first (which differs), then one layer of each of its kinds
   (``layer_types``: a layer type of ``config.layer_types``, sliding and full attention in Gemma-2 for
   example, with its own sizes where the config sets them layer by layer, Gemma 4's);
2. the architecture's own classes are built on the meta device, LoRA attached and checkpointing
   enabled exactly as the run does (``adapters.attach_lora``, ``checkpointing.enable_checkpointing``),
   the 4-bit linears standing in as frozen linears of the compute dtype (what bitsandbytes' 4-bit
   matmul keeps for backward, its packed weight, is a parameter, and parameters are not counted);
3. every parameter is wrapped as a ``FakeTensor`` on the CPU, so kernels are picked as on a real
   device (sdpa's fused kernel, not the meta device's math fallback), and one forward pass at the
   real batch x sequence records each layer's saved bytes, in well under a second for a 70B model.

Three traces, no checkpointing, every layer checkpointed and every layer selectively checkpointed, give
the figures any policy, and any mix of policies per layer, is composed from: a kept, a checkpointed and a
selective layer of each type, and the first layer in each trace (which also holds what the layers share:
the rotary tables, the attention mask). The selective trace also counts what a recompute costs
(``recompute_cost``): each op of a layer costs its FLOPs (torch's ``flop_counter`` formulas) or
``BALANCE`` FLOPs per byte it writes, whichever is larger (an element-wise op is bound by memory
traffic, a matmul by arithmetic), and a 4-bit linear's op also writes its dequantized weight. A full
layer's recompute costs all of its ops, a selective layer's the ops the policy does not keep. What tracing cannot
see stays closed-form in the planner: 4-bit weight bytes, optimizer state, CUDA transients, and on CUDA
the dropout masks, which are 1 byte per value there against 4 on the CPU. With the chunked loss head
(``loss_head.py``) the run's forward pass stops before the head (``final_hidden_states``): its figure
outside the layers is what the full-logits trace held there when the head was called
(``fake_forward.BEFORE_HEAD``, equal to the byte to a trace of that forward on every builtin and
shipped recipe), so one trace serves both heads; which positions the head then keeps depends on the
labels' values, which fake tensors do not have, so that selection is closed form (it is a tensor of
known shape per trained position: the hidden state and its label).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from qlora_kit.memory import fake_forward
from qlora_kit.memory.accounting import OUTSIDE
from qlora_kit.memory.fake_forward import Shape
from qlora_kit.memory.loss_head import uses_chunked_loss
from qlora_kit.model import layer_sizes
from qlora_kit.registries import checkpointing as table
from qlora_kit.registries import family_traits

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TracedLayers:
    """Saved bytes per layer, from the three traces; any policy's figures are composed from these."""

    layer_types: tuple[str, ...]  # the full model's, one per layer
    first_kept: int  # layer 0 without checkpointing: its input needs no gradient, it holds the shared tensors
    kept: dict[str, int]  # a later layer of each type, not checkpointed
    first_checkpointed: int  # layer 0 checkpointed: its input, and the shared tensors
    checkpointed: dict[str, int]  # a later layer of each type, checkpointed
    head: int  # the final norm and transformers' loss
    head_checkpointed: int  # the same under checkpointing, which makes the embeddings' output need a
    # gradient (so an embedding dropout, GPT-2's, keeps its mask)
    first_selective: int = (
        0  # layer 0 selectively checkpointed: its input, the kept ops' outputs, shared tensors
    )
    selective: dict[str, int] = field(default_factory=dict)  # a later layer of each type, selective
    # recompute cost (FLOP-equivalents, see BALANCE) of layer 0 and of a later layer of each type:
    # (full, selective)
    first_cost: tuple[float, float] = (0.0, 0.0)
    cost: dict[str, tuple[float, float]] = field(default_factory=dict)
    chunked_head: bool = False  # the run uses the chunked loss head: ``head`` is its forward pass without
    # the selection of trained positions (the planner adds that)
    # head and head_checkpointed under the chunked head (fake_forward.BEFORE_HEAD): the trace of full
    # logits gives both heads' figures, so one trace serves memory.chunked_loss true, false and auto
    chunked_heads: tuple[int, int] = (0, 0)
    kernels: tuple[str, ...] = ()  # the attention kernels the traces ran (device_kernels.py)
    # What the first layer that keeps its ops holds beyond a later kept layer when layer 0 is checkpointed
    # (every_n): the tensors every layer shares (the rotary tables), which a kept layer 0 holds in
    # first_kept and a checkpointed one does not hold at all (issue 82: every_n planned 2.4-5.4% low)
    shared_after_checkpointed: int = 0

    def per_layer(self, policies: list[str] | list[bool]) -> list[int]:
        """Bytes per layer for each layer's policy (none, selective or full; or checkpointed flags). Layer 0
        is checkpointed under any policy that checkpoints at all (transformers' every_n_layers counts from
        it; ``auto`` keeps it so); a plan written by hand that leaves it alone while checkpointing others
        is planned as if its input needed no gradient."""
        # a layer's figures are those of the trace of what its policy keeps (table.KINDS' order)
        first = dict(
            zip(table.KINDS, (self.first_kept, self.first_checkpointed, self.first_selective), strict=True)
        )
        later = dict(zip(table.KINDS, (self.kept, self.checkpointed, self.selective), strict=True))
        figures, shared_held = [], False
        for index, (kind, policy) in enumerate(zip(self.layer_types, policies, strict=True)):
            kept = table.policy({True: table.FULL, False: table.NONE}.get(policy, policy)).keeps
            figures.append(first[kept] if index == 0 else later[kept][kind])
            if index == 0:
                shared_held = kept != table.KEEPS_INPUT  # layer 0 keeps ops: it holds the shared tensors
            elif kept == table.KEEPS_ALL and not shared_held:
                figures[-1] += self.shared_after_checkpointed
                shared_held = True
        return figures

    def with_chunked_head(self) -> TracedLayers:
        """These figures with the chunked loss head's ``head`` and ``head_checkpointed``."""
        head, head_checkpointed = self.chunked_heads
        return replace(self, head=head, head_checkpointed=head_checkpointed, chunked_head=True)

    def recompute_cost(self, policies: list[str]) -> list[float]:
        """What each layer's backward recomputes, in FLOP-equivalents (0 for a layer that keeps its ops)."""
        column = dict(zip(table.KINDS, (None, 0, 1), strict=True))
        costs = []
        for index, (kind, policy) in enumerate(zip(self.layer_types, policies, strict=True)):
            pair = self.first_cost if index == 0 else self.cost[kind]
            which = column[table.policy(policy).keeps]
            costs.append(0.0 if which is None else pair[which])
        return costs


def layer_types(config) -> tuple[str, ...]:
    """Each decoder layer's kind: its type (``config.layer_types``), and where layers differ beyond it, its
    own sizes and whether it reuses an earlier layer's keys and values (``layer_sizes``: Gemma 4)."""
    text = config.get_text_config()
    types = getattr(text, "layer_types", None)
    if not (isinstance(types, (list, tuple)) and len(types) == text.num_hidden_layers):
        types = ("decoder",) * text.num_hidden_layers
    kinds = []
    for index, (kind, reused) in enumerate(zip(types, layer_sizes.kv_reused(text), strict=True)):
        sizes = layer_sizes.layer_sizes(text, index)
        kinds.append(
            " ".join(
                (str(kind), *(f"{name}={value}" for name, value in sizes.items()), *(["kv-reused"] * reused))
            )
        )
    return tuple(kinds)


def first_of_each_kind(types: tuple[str, ...]) -> tuple[int, ...]:
    """The first layer, then the first layer of each kind (in the order they appear)."""
    first = {}
    for index, kind in enumerate(types):
        first.setdefault(kind, index)
    return (0, *first.values())


def trace_layers(
    config,
    recipe: Recipe,
    batch: int,
    seq: int,
    precision: str = "no",
    images: int = 1,
    device: str = "cpu",
    padded: bool = True,
) -> TracedLayers | None:
    """The traced figures under the Trainer's autocast ``precision`` (bf16, fp16 or no), or None (logged)
    when this architecture's code cannot run on fake tensors. A vision-language row holds ``images``;
    attention runs the kernel ``device`` picks (``device_kernels``); unpacked rows are ``padded`` (a batch
    with an attention mask) or of one length (none)."""
    key = (
        config.to_json_string(),
        recipe.model_dump_json(
            include={
                "model": True,
                "quant": True,
                "lora": True,
                "data": True,
                # not memory.checkpointing, every_n nor layer_policies: every trace sets its own layer policy
                # (_trace_both traces all three, and every_n's spacing at 2), so plans that differ only there
                # (plan --max-seq-len's ways, auto's per-layer choices) share their traces; nor the
                # head (one trace gives both), nor what no trace reads: the chunked head's chunk (formula.py
                # sizes a chunk), the budget (memory.chunked_loss auto plans up to 7 chunks against it) and
                # where the experts wait (experts_plan.resolve moves the plan's static bytes, after the trace)
                "memory": set(type(recipe.memory).model_fields)
                - {"checkpointing", "every_n", "layer_policies", "chunked_loss", "loss_chunk_tokens"}
                - {"budget_gb", "experts_on_host"},
                "train": {"objective"},
            }
        ),
    )
    key += (batch, seq, precision, images, device, padded)
    if key not in _TRACED:
        # traced with full logits, whose forward also gives the chunked head's figures (BEFORE_HEAD)
        full_logits = recipe.model_copy(
            update={"memory": recipe.memory.model_copy(update={"chunked_loss": False})}
        )
        try:
            shape = Shape(batch, seq, images, device, padded)
            _TRACED[key] = _trace_both(config, full_logits, shape, precision)
        except Exception as exc:  # a foreign model's code that fake tensors cannot run: the formula instead
            log.info("planner: tracing %s failed (%s); using the formula", config.model_type, exc)
            _TRACED[key] = None
    traced = _TRACED[key]
    return traced.with_chunked_head() if traced is not None and uses_chunked_loss(recipe, config) else traced


_TRACED: dict[tuple, TracedLayers | None] = {}  # a plan asks for every policy: three traces serve them all


def _trace_both(config, recipe: Recipe, shape: Shape, precision: str) -> TracedLayers:
    types = layer_types(config)
    picked = first_of_each_kind(types)
    short_types = tuple(types[index] for index in picked)
    short = fake_forward.cut(config, picked)
    kernels: set[str] = set()
    # one trace of each kind of layer the table's policies keep
    plain, _ = fake_forward.trace(short, recipe, table.of_kind(table.KEEPS_ALL), shape, precision, kernels)
    full, _ = fake_forward.trace(short, recipe, table.of_kind(table.KEEPS_INPUT), shape, precision, kernels)
    chosen, costs = fake_forward.trace(
        short, recipe, table.of_kind(table.KEEPS_EXPENSIVE), shape, precision, kernels
    )
    later = range(1, len(short_types))
    shared = 0
    if len(short_types) > 1:  # layer 0 checkpointed, layer 1 kept (every_n's start): what layer 1 holds more
        spaced = recipe.model_copy(update={"memory": recipe.memory.model_copy(update={"every_n": 2})})
        after, _ = fake_forward.trace(short, spaced, table.every_n(), shape, precision, kernels)
        shared = after["layer 1"] - plain["layer 1"]
    if any(getattr(config.get_text_config(), key, None) for key in family_traits.MODEL_TENSORS_PER_LAYER):
        # tensors as wide as the model is deep (Gemma 4's per-layer embeddings, saved where a layer first
        # keeps a view of them): trace the cut once more with its last layer twice, and add what each figure
        # grew by once for each layer the cut leaves out
        longer = fake_forward.cut(config, (*picked, picked[-1]))
        left_out = len(types) - len(picked)

        def grown(figures: dict[str, int], kind: str) -> dict[str, int]:
            more, _ = fake_forward.trace(longer, recipe, table.of_kind(kind), shape, precision, kernels)
            return {key: value + left_out * (more[key] - value) for key, value in figures.items()}

        plain, full = grown(plain, table.KEEPS_ALL), grown(full, table.KEEPS_INPUT)
        chosen = grown(chosen, table.KEEPS_EXPENSIVE)
    return TracedLayers(
        layer_types=types,
        first_kept=plain["layer 0"],
        kept={short_types[i]: plain[f"layer {i}"] for i in later},
        first_checkpointed=full["layer 0"],
        checkpointed={short_types[i]: full[f"layer {i}"] for i in later},
        head=plain[OUTSIDE],
        head_checkpointed=full[OUTSIDE],
        first_selective=chosen["layer 0"],
        selective={short_types[i]: chosen[f"layer {i}"] for i in later},
        first_cost=costs["layer 0"],
        cost={short_types[i]: costs[f"layer {i}"] for i in later},
        chunked_heads=(plain[fake_forward.BEFORE_HEAD], full[fake_forward.BEFORE_HEAD]),
        kernels=tuple(sorted(kernels)),
        shared_after_checkpointed=shared,
    )
