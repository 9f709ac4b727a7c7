"""Peak-memory prediction from a model config alone (no weights): ``qlora-kit plan RECIPE``.

The model is built on the meta device from its config, so every parameter's shape is exact; nothing
is downloaded but the config. The activations each checkpointing policy keeps are traced from the
model's own code (``tracing.py``); the rest is closed form. Terms, for N = batch x sequence tokens,
c = bytes of the compute dtype, r = LoRA rank, L layers, V vocabulary:

Weights (``shapes.py``): 4-bit linears with their quantization constants, unquantized layers, LoRA; a
mixture of experts' fused expert stacks, every expert held in 4 bits (``shapes.stack_bytes``).
- LoRA gradients: as many fp32 values as LoRA parameters; AdamW state 8 bytes per
  value (32-bit) or 2 + 8/256 (8-bit: two uint8 moments and an fp32 absmax per 256-block, plus two
  1 KiB quantization maps per tensor; tensors under 4,096 values stay 32-bit).

Activations kept for backward: traced (``tracing.py``) under the autocast the Trainer will use, through
the loss head the run will use (``loss_head.uses_chunked_loss``: Gemma-2's soft-capped head keeps
transformers' loss). Closed form: which positions the chunked head keeps (from config alone every
position is assumed trained, and prompt tokens it skips make the plan over-predict; a run plans from
its data: at most its examples' largest trained share of a micro-batch's positions, an upper bound
for packed and padded rows alike), and on CUDA dropout masks, corrected from
the CPU's 4 bytes a value to 1. Unpacked rows are planned as a padded batch (with the attention mask
transformers builds for one) and packed rows as holding two examples each (with their block-diagonal
mask): a batch of rows of one length, or of one example each, keeps no mask, and the plan over-predicts
it by that mask. When a model's code cannot run on fake tensors, the formula below, written for a
Llama-shaped layer, is used instead (and ``plan`` says so):
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
  (batch x (seq - 1)), logits never kept; n_trained as above (every position without the data).

``memory.experts_on_host`` (a mixture's experts in host memory, two layers' on the device, kept on the host
as they load) and the experts' dequantized working set are planned in ``experts_plan.py``.

With ``memory.offload_activations`` the checkpointed layers' inputs leave the device (the trace counts them
as host bytes: ``PolicyPlan.host``), and backward holds two of them back on it (the one recomputing, the one
prefetched). With ``memory.mlp_tiles`` the trace runs the tiled MLP, so its intermediate counts one tile's.

Transients on top of what is kept, whichever is larger: the loss head's logits (N x V x (c + 4 + 4):
16-bit logits, their fp32 copy, log-probabilities; one chunk of tokens with the chunked loss), or the
backward pass's recompute spike: one decoder layer's full activations, rematerialised, plus the LoRA
gradients and two N x hidden x c hidden-state gradients in flight; for a mixture of experts in 4 bits, one
expert's largest weight dequantized (the experts run one at a time, so this is the working set of the
experts a batch hits: their kept activations are traced, with the batch's picks spread evenly over them,
which keeps the same bytes as any routing of the same picks; the router's logits and top-k are traced too).

peak = weights + LoRA parameters + optimizer state + kept activations + max(transients).

GRPO (``train.objective: grpo``) trains on micro-batches of prompt + completion sequences as above, and
before each optimizer step samples its rollouts without gradients, when nothing is kept for backward:
``formula.rollout_bytes``, the KV cache of one generation batch (micro_batch_size x grad_accum sequences of up
to data.max_seq_len tokens: 2 x layers x kv_heads x head_dim x c per token) plus each sequence's
next-token logits in fp32 and their sampling probabilities (sequences x V x 8). The peak is the larger of
training's and the weights + optimizer state + rollouts.
The GPU's CUDA context and allocator fragmentation come on top and are not predicted.

Under FSDP (``train.fsdp``) over P processes, per GPU: 1/P of the 4-bit weights, of the LoRA parameters
and gradients and of the optimizer state, plus what FSDP2 gathers whole: the layer being computed and
the one prefetched (two layers' weights), and the root module (embeddings, final norm, head), which
stays gathered from forward to backward; each process's activations are its own micro-batch's, as
without FSDP. Loading needs the whole 4-bit model on every GPU first (``load_peak``): transformers
loads a quantized model on every process before FSDP shards it. (A mixture's experts load in 16 bits and
are packed after: on the device, with them resident; on the host, with ``memory.experts_on_host``.)
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qlora_kit.memory import experts_plan
from qlora_kit.memory.formula import (
    Activations,
    gradient_working_set,
    loss_spike,
    rollout_bytes,
)
from qlora_kit.memory.kept_activations import activation_bytes, layer_plan  # planner's names too
from qlora_kit.memory.pixels import pixel_bytes
from qlora_kit.memory.shapes import (
    DTYPE_BYTES,
    ModelShape,
    Weights,
    lora_tensor_values,
    model_shape,
    weight_bytes,
)
from qlora_kit.memory.tiled_mlp import tile_count
from qlora_kit.model.precision import Device, resolve_mixed_precision
from qlora_kit.registries import checkpointing as table
from qlora_kit.registries import objectives
from qlora_kit.registries.optimizers import OPTIMIZERS

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)

GIB = 1024**3


@dataclass
class PolicyPlan:
    policy: str  # "none", "full", "selective", "every_n=2", "per_layer"
    activations: int
    spike: int
    peak: int
    recompute_layers: int
    layers: list[str] = field(default_factory=list)  # each layer's policy: none, selective or full
    recompute_cost: float = 0.0  # what backward recomputes, in full layers' worth (tracing.RecomputeCost)
    host: int = 0  # memory.offload_activations: the checkpointed layers' inputs, in host memory


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
    head_source: str = "closed form"  # the loss head's: "traced", or traced with its selection closed form
    policies: list[PolicyPlan] = field(default_factory=list)
    shards: int = 1  # FSDP processes the weights and optimizer state are sharded over (1: not sharded)
    rollout: int = 0  # train.objective grpo: the rollouts' KV cache and logits (rollout_bytes)
    pixels: int = 0  # a vision-language batch's images, as the image processor hands them (pixel_bytes)
    images_per_row: int | None = None  # the data's most images in a row (None: images_in_a_row's bound)
    device: str = "cuda"  # the device planned for
    recipe: Recipe | None = None  # the recipe planned
    # The largest share of an example's tokens that are trained (PreparedData.largest_trained_share):
    # 1.0, every position, when the data is not seen (qlora-kit plan); a run plans from its data.
    trained_share: float = 1.0
    # unpacked rows padded (the attention mask transformers builds for them kept) or all of one length
    # (rows truncated to data.max_seq_len: no mask, and on CUDA the flash kernel)
    padded: bool = True
    kernels: tuple[str, ...] = ()  # the attention kernels the trace assumed (device_kernels.py)
    experts_on_host: bool = False  # memory.experts_on_host, resolved (experts_plan.resolve)

    @property
    def trained_positions(self) -> int | None:
        """At most how many positions of a micro-batch the chunked head keeps (None: every one)."""
        if self.trained_share >= 1.0:
            return None
        return min(self.batch * (self.seq - 1), math.ceil(self.trained_share * self.batch * self.seq))

    @property
    def layer_weights(self) -> int:
        """One decoder layer's weights, 4-bit and LoRA: what FSDP gathers whole to compute it."""
        return (self.weights.quantized + self.weights.experts + self.weights.lora) // self.shape.layers

    @property
    def lora_grads(self) -> int:
        """LoRA gradients (fp32, one per parameter) exist during backward; under FSDP each GPU keeps its
        shard of them, plus the layer being reduced."""
        if self.shards == 1:
            return self.weights.lora
        return self.weights.lora // self.shards + self.weights.lora // self.shape.layers

    @property
    def static(self) -> int:
        """Weights and optimizer state one GPU holds while it trains."""
        w = self.weights
        if self.shards == 1:
            return w.total - self.host_experts + self.experts_in_flight + self.optimizer_state
        sharded = (w.quantized + w.experts + w.lora + self.optimizer_state) // self.shards
        return sharded + w.unquantized + 2 * self.layer_weights

    @property
    def load_peak(self) -> int:
        """What one GPU holds while the model loads: the whole 4-bit model, under FSDP too; with
        memory.experts_on_host all of it but the experts, and one layer's of them (experts_plan.py)."""
        at_load = experts_plan.experts_at_load(
            self.shape, self.recipe, self.weights.experts, self.experts_on_host
        )
        return self.weights.quantized + at_load + self.weights.unquantized

    @property
    def host_experts(self) -> int:
        """memory.experts_on_host: every layer's packed experts and statistics, in pinned host memory."""
        return self.weights.experts if self.experts_on_host else 0

    @property
    def experts_in_flight(self) -> int:
        """memory.experts_on_host: two layers' experts on the device (the one computing, the one arriving)."""
        return experts_plan.in_flight(self.shape, self.recipe, self.experts_on_host)

    @property
    def experts_copied_per_step(self) -> int:
        """memory.experts_on_host: bytes copied host to device per optimizer step (experts_plan.py)."""
        return experts_plan.copied_per_step(self.host_experts, self.recipe.train.grad_accum)

    def chosen(self, recipe: Recipe) -> PolicyPlan:
        return next(
            p
            for p in self.policies
            if p.policy == policy_name(recipe.memory.checkpointing, recipe.memory.every_n)
        )

    def grpo_peaks(self, row: PolicyPlan) -> str:
        """GRPO's two peaks under one policy, which sets the step's peak, and the knobs that move each."""
        rollouts = self.static + self.rollout
        policy_step = self.static + row.activations + row.spike
        sets = "the rollouts set" if rollouts >= policy_step else "the policy step sets"

        def size(n: int) -> str:
            return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / 2**20:.1f} MiB"

        return (
            f"GRPO's two peaks: rollouts {size(rollouts)} (KV cache and logits of train.micro_batch_size "
            "x grad_accum sequences: fewer of them, a lower grpo.max_completion_length or data.max_seq_len; "
            "grpo.num_generations only groups them), the policy step "
            f"{size(policy_step)} under {row.policy} (a lower train.micro_batch_size, grpo.max_completion_length "
            f"or data.max_seq_len, more memory.checkpointing): {sets} the peak"
        )

    def fitting(self, budget_gb: float) -> list[PolicyPlan]:
        return [p for p in self.policies if p.peak <= budget_gb * GIB]

    def activations(self, policy: str | list[str], every_n: int = 1) -> Activations:
        return activation_bytes(
            self.shape,
            self.recipe,
            policy,
            every_n,
            self.batch,
            self.seq,
            self.device,
            self.trained_positions,
            self.precision,
            self.images_per_row,
            self.padded,
        )

    def policy_plan(self, layers: list[str], label: str) -> PolicyPlan:
        """The row of one plan of per-layer policies: what is kept, backward's largest transient, the peak."""
        recipe, shape = self.recipe, self.shape
        acts = self.activations(layers)
        # Backward holds the LoRA gradients and two hidden-state gradients in flight; in the head's backward
        # its logits' gradients (loss_spike), in a layer's the gradients at its widest linear and, when the
        # layer was checkpointed (fully or selectively), its activations rematerialised: the recompute
        # spike, the peak a run must fit (a forward's peak is below the head's backward).
        tokens = self.batch * self.seq
        in_flight = self.lora_grads + 2 * tokens * shape.hidden * DTYPE_BYTES[recipe.quant.compute_dtype]
        tiles = tile_count(recipe.memory.mlp_tiles, self.seq, shape.hidden)
        tile_tokens = self.batch * math.ceil(self.seq / tiles) if tiles > 1 else None
        backward = in_flight + gradient_working_set(shape, recipe, tokens, tile_tokens)
        recomputed = sum(table.recomputes(p) for p in layers)
        if recomputed:  # layer i recomputes when the layers above it have freed theirs: the worst such i
            whole = self.activations(table.NONE).per_layer
            kept = acts.per_layer
            backward += max(0, max(sum(kept[:i]) + whole[i] for i in range(len(kept))) - sum(kept))
        backward += self.mlp_tile_transient() + self.dequantized_expert()
        host = self.offloaded(recomputed)
        if host:  # the input being recomputed from, back on the device, and the next one prefetched
            backward += 2 * host // recomputed
        # The head's saved tensors are released once its backward has run (autograd frees a node's saved
        # tensors after its backward), before any decoder layer's backward: the layers' spike is on top
        # of the layers' kept bytes alone, the loss head's on top of all of them.
        spike = max(in_flight + loss_spike(shape, recipe, tokens), backward - acts.head)
        peak = self.peak_of(acts.total, spike)
        full_layer = max(self.activations(table.FULL).recompute_cost) or 1.0
        cost = sum(acts.recompute_cost) / full_layer
        return PolicyPlan(label, acts.total, spike, peak, recomputed, layers, cost, host)

    def peak_of(self, activations: int, spike: int) -> int:
        """A row's peak from what it keeps and its largest transient, on top of this plan's static bytes."""
        return max(self.training_peak(activations, spike), self.load_peak)

    def training_peak(self, activations: int, spike: int) -> int:
        """The peak once the model is loaded: a step's, or GRPO's rollouts'."""
        return max(self.static + self.pixels + activations + spike, self.static + self.rollout)

    def mlp_tile_transient(self) -> int:
        """memory.mlp_tiles: one tile's MLP activations, alive while backward recomputes that tile (the trace
        keeps none of them): gate, up and their product (3 x intermediate x c a token) and the fp32 inputs
        LoRA keeps of the three projections ((2 hidden + intermediate) x 4)."""
        shape, memory = self.shape, self.recipe.memory
        tiles = tile_count(memory.mlp_tiles, self.seq, shape.hidden)
        if tiles == 1:
            return 0
        tokens = self.batch * math.ceil(self.seq / tiles)
        c = DTYPE_BYTES[self.recipe.quant.compute_dtype]
        return tokens * (3 * shape.intermediate * c + (2 * shape.hidden + shape.intermediate) * 4)

    def dequantized_expert(self) -> int:
        """A mixture's expert weights dequantized at once for their tokens' matmuls (experts_plan.py)."""
        return experts_plan.dequantized_expert(self.shape, self.recipe, self.device)

    def offloaded(self, recomputed_layers: int) -> int:
        """Host bytes of offloaded checkpoints: each recomputed layer's input (batch x seq x hidden in the
        compute dtype; the trace counts them off the device, ``offload.py``)."""
        if not self.recipe.memory.offload_activations:
            return 0
        token = self.shape.hidden * DTYPE_BYTES[self.recipe.quant.compute_dtype]
        return recomputed_layers * self.batch * self.seq * token


def policy_name(policy: str, every_n: int = 1) -> str:
    return f"{policy}={every_n}" if table.policy(policy).expands == table.EVERY_N else policy


def candidate_policies(layers: int) -> list[tuple[str, int]]:
    """The table's candidates, from the most memory to the least: none, every L-th layer ... every 2nd,
    selective, full."""
    spaced = sorted({n for n in range(2, layers + 1)}, reverse=True)
    # Keep the every_n values that checkpoint a different number of layers.
    seen, every = set(), []
    for n in spaced:
        count = math.ceil(layers / n)
        if count not in seen:
            seen.add(count)
            every.append((table.every_n(), n))
    candidates = [(name, spec) for name, spec in table.POLICIES.items() if spec.candidate]
    return [
        w for n, s in candidates for w in (every if s.expands == table.EVERY_N else [(n, int(s.recomputes))])
    ]


def plan(
    recipe: Recipe,
    batch: int | None = None,
    seq: int | None = None,
    device: str = "cuda",
    processes: int = 1,
    trained_share: float = 1.0,
    images_per_row: int | None = None,
    image_tokens: int | None = None,
    padded: bool = True,
) -> Plan:
    """Predict memory for every checkpointing policy at the recipe's (or the given) batch x sequence
    (a DPO batch of n pairs is 2n sequences; its reference forward runs without grad and keeps
    nothing); per GPU of ``processes`` (sharded over them with ``train.fsdp``, replicated without);
    ``trained_share``: the data's largest trained share of an example (``Plan.trained_share``);
    ``images_per_row``: a vision-language data's most images in a row (``images_in_a_row``);
    ``image_tokens``: a dynamic-resolution data's most image tokens in a row (``patches_in_a_row``);
    ``padded``: unpacked rows padded to the longest (the default, the larger) or all of one length."""
    shape = model_shape(recipe)
    # train.objective dpo: each pair is two sequences (chosen and rejected) in one forward pass
    batch = batch or recipe.train.micro_batch_size * objectives.of(recipe).sequences_per_row
    seq = seq or recipe.data.max_seq_len
    weights = weight_bytes(shape, recipe)
    per_tensor = lora_tensor_values(shape, recipe)  # the experts' stacked LoRA too: state is per tensor
    optimizer = OPTIMIZERS[recipe.optimizer.name]
    state = sum(optimizer.state_bytes(v) for v in per_tensor)
    pageable = sum(optimizer.state_bytes(v) for v in per_tensor if optimizer.pageable(v))
    # what the Trainer's autocast will be on that device (a GPU: quant.compute_dtype's, by default)
    precision = resolve_mixed_precision(recipe, Device(cuda=device == "cuda", bf16=True))
    result = Plan(shape, weights, state, pageable, batch, seq, precision, device=device, recipe=recipe)
    result.trained_share, result.padded = trained_share, padded
    result.shards = processes if recipe.train.fsdp else 1
    result.rollout = rollout_bytes(shape, recipe) if objectives.of(recipe).rollouts else 0
    result.images_per_row = images_per_row
    result.pixels = pixel_bytes(shape.config, recipe, batch, images_per_row, image_tokens)
    uncheckpointed = result.activations(table.NONE)
    result.activation_source, result.head_source = uncheckpointed.source, uncheckpointed.head_source
    result.kernels = uncheckpointed.kernels
    wanted = candidate_policies(shape.layers)
    spec = table.policy(recipe.memory.checkpointing)
    own = (spec.name, int(spec.recomputes) if spec.layer else recipe.memory.every_n)
    if not table.planned(spec.name) and policy_name(*own) not in {policy_name(*w) for w in wanted}:
        wanted.append(own)  # the recipe's own every_n (another n checkpoints as many layers), or per_layer
    for policy, every_n in wanted:
        label = policy_name(policy, every_n)
        result.policies.append(result.policy_plan(layer_plan(policy, every_n, shape.layers, recipe), label))
    return experts_plan.resolve(result, recipe)  # memory.experts_on_host, auto decided by the plan
