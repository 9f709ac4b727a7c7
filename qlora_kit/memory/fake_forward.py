"""One forward pass of a recipe's model on fake tensors, counted: what ``tracing`` composes its figures from.

``trace`` builds the architecture's own classes on the meta device (LoRA attached and checkpointing
enabled as the run does), wraps every parameter as a ``FakeTensor`` on the CPU, and runs one training
forward at the batch's shape under the run's autocast and the target device's attention kernel
(``device_kernels``), counting what autograd saves per layer (``accounting.SavedTensors``) and, for
the selective policy, each layer's recompute cost (``RecomputeCost``). The batch is the collator's:
every position trained, packed rows with restarting positions, a padded batch with its mask.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import flop_registry
from transformers import masking_utils

from qlora_kit.memory import device_kernels, selective
from qlora_kit.memory.accounting import OUTSIDE, HeldBeforeHead, SavedTensors, decoder_layers
from qlora_kit.memory.loss_head import final_hidden_states, uses_chunked_loss
from qlora_kit.memory.tiled_mlp import tile_count
from qlora_kit.model import layer_sizes, vision
from qlora_kit.registries import attention

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

# FLOPs per byte at which an op's memory traffic costs as much as its arithmetic: the machine balance,
# ~300 on an H100 (990 dense bf16 TFLOP/s over 3.35 TB/s), ~20-60 on CPUs. Only the ratio between a
# selective and a full recompute depends on it; 64 ranks them as the CPU measurements here do
# (benchmarks/memory.py's frontier).
BALANCE = 64
# A key of trace's figures beside the layers' and OUTSIDE: what was held outside the layers when the head
# was called, which is all a run with the chunked head holds there (it runs the forward without the head:
# final_hidden_states), to the byte on every builtin and shipped recipe. One forward gives both heads' figures.
BEFORE_HEAD = "outside, before the head"

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Shape:
    """What a trace runs: the batch's shape, and the device whose kernels it assumes."""

    batch: int
    seq: int
    images: int = 1  # a vision-language row's images
    device: str = "cpu"  # cuda: attention runs CUDA's kernel choice (device_kernels.py)
    padded: bool = True  # unpacked rows padded (transformers' attention mask) or of one length (none)


def cut(config, layers: tuple[int, ...]):
    """A copy of the config with just these decoder layers (indices into the model's, in order), each of its
    own type and sizes (``layer_sizes``), the ones that reuse an earlier layer's keys and values (Gemma 4's
    last layers) still reusing them: a cut layer of each type that computes them stays before them."""
    text = config.get_text_config()
    sizes = [layer_sizes.layer_sizes(text, index) for index in layers]
    reused = layer_sizes.kv_reused(text)
    short = copy.deepcopy(config)
    text_short = short.get_text_config()
    if layer_sizes.is_heterogeneous(text_short):
        text_short.per_layer_config = None  # its indices are the model's: set again for the cut's below
    text_short.num_hidden_layers = len(layers)
    if getattr(text_short, "layer_types", None) is not None:
        text_short.layer_types = [text.layer_types[index] for index in layers]
    if layer_sizes.is_heterogeneous(text):
        text_short.per_layer_config = dict(enumerate(sizes))
    if getattr(text_short, "num_kv_shared_layers", 0):
        text_short.num_kv_shared_layers = sum(reused[index] for index in layers)
    return short


def trace(
    config,
    recipe: Recipe,
    policy: str,
    shape: Shape,
    precision: str,
    kernels: set[str],
    counter: Callable[[torch.nn.Module], SavedTensors] = SavedTensors,
) -> tuple[dict[str, int], dict[str, tuple[float, float]]]:
    """Saved bytes per layer (and outside them); under ``selective``, also each layer's recompute cost
    (full, selective). The attention kernels it ran are added to ``kernels``; ``counter`` makes the
    ``SavedTensors`` that counts (``saved_by_op`` passes one that also labels each op)."""
    # whatever the trace draws at random (a module's init on the CPU's generator, even for a model on the
    # meta device) from a stream of its own, or the run that plans before it loads would start from other
    # weights than one that does not (and a resumed run from others than its first part, whose plan built
    # the builtin)
    with torch.random.fork_rng(devices=[]):
        if counter is not SavedTensors:  # saved_by_op labels the ops of one trace: every expert is traced
            return _trace(config, recipe, policy, shape, precision, kernels, counter)[:2]
        return _trace_few_experts(config, recipe, policy, shape, precision, kernels)


# A mixture's experts run one at a time in the trace (the CPU's loop, expert_matmul.py), so a trace of every
# expert costs time in proportion to the experts: 30 s for Qwen3-Next's 512, and a plan traces four times.
# Its figures are linear in the experts routed (expert_matmul.route): two traces, of FEW_EXPERTS and one
# more, give every expert's figures exactly (the saved bytes to the byte: tests/test_tracing.py).
FEW_EXPERTS = 2


def _trace_few_experts(config, recipe, policy, shape, precision, kernels):
    from qlora_kit.model import expert_matmul

    def traced(routed: int):
        few = expert_matmul.FewExperts(routed)
        token = expert_matmul.FEW_EXPERTS.set(few)
        try:
            return (*_trace(config, recipe, policy, shape, precision, kernels, SavedTensors), few.capped)
        finally:
            expert_matmul.FEW_EXPERTS.reset(token)

    saved, costs, experts, capped = traced(FEW_EXPERTS)
    if not capped:  # a dense model, or experts as few as the picks: that trace was every expert's
        return saved, costs
    more_saved, more_costs, _, _ = traced(FEW_EXPERTS + 1)

    def at_every(name: str, few: float, more: float):
        return few + (experts.get(name, FEW_EXPERTS) - FEW_EXPERTS) * (more - few)

    every_saved = {name: at_every(name, saved[name], more_saved[name]) for name in saved}
    every_cost = {
        name: tuple(at_every(name, *pair) for pair in zip(costs[name], more_costs[name], strict=True))
        for name in costs
    }
    return every_saved, every_cost


def _routed_experts(model) -> dict[str, int]:
    """Each decoder layer's routed experts (by the trace's layer names), of the layers that have any."""
    from qlora_kit.model import moe_experts

    stacks = {id(module) for _, module in moe_experts.fused_experts(model)}
    counts = {}
    for index, layer in enumerate(decoder_layers(model)):
        found = [getattr(m, "num_experts", 0) for m in layer.modules() if id(m) in stacks]
        if found:
            counts[f"layer {index}"] = max(found)
    return counts


def _trace(config, recipe, policy, shape, precision, kernels, counter):
    batch, seq, images = shape.batch, shape.seq, shape.images
    from qlora_kit.memory import checkpointing
    from qlora_kit.model import adapters, moe_experts

    kernel = attention.kernel(recipe.model.attn_implementation)
    # Flash and flex kernels cannot run on fake CPU tensors (flex's block mask reads data pointers and
    # crashes); sdpa without a mask keeps what they keep (q, k and v unrepeated, the output and the
    # log-sum-exp), over the rows flex is given or the one flattened sequence a flash kernel is given.
    resolved = attention.resolve(kernel.name, config) or "sdpa"
    traced_as = resolved if resolved in ("sdpa", "eager") else "sdpa"
    flash = kernel.packing == "flattened"
    dtype = getattr(torch, recipe.quant.compute_dtype)
    facet = vision.vision_of(config)
    with torch.device("meta"):
        model = vision.auto_class(config).from_config(
            config,
            dtype=dtype,
            trust_remote_code=recipe.model.trust_remote_code,
            attn_implementation=traced_as,
        )
    for each in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        each.use_cache = False
    if facet is not None:
        _placeholders_without_count_check(model)
    model.requires_grad_(False)
    experts = _routed_experts(model)
    if recipe.quant.bits == 4 and experts:
        moe_experts.use_routed_loop(model)  # the experts' loop a 4-bit load runs (its matmuls keep the same)
    # The tiled MLP keeps views of one storage however many tiles there are: two tiles trace what any
    # number keeps, and tracing hundreds of tiles costs minutes (one tile's own transient: planner.py)
    tiles = min(tile_count(recipe.memory.mlp_tiles, seq, config.get_text_config().hidden_size), 2)
    memory = recipe.memory.model_copy(update={"checkpointing": policy, "mlp_tiles": tiles})
    checkpointing.enable_checkpointing(model, memory)
    # LoRA's factors made on the meta device (peft's low_cpu_mem_usage), where the trace needs only their
    # shapes and dtypes: made on the CPU and drawn they cost a fifth of tracing the shipped recipes (the
    # experts' stacks the most), then moved to the meta base's dtype and back by peft's cast: float32 either way
    peft_model = adapters.attach_lora(model, recipe.lora, empty=True)
    mode = FakeTensorMode()
    _fake_on_cpu(peft_model, mode)
    peft_model.train()
    # accelerate runs the forward under this autocast on a GPU and on a CPU alike (precision.py)
    dtype = AUTOCAST.get(precision)
    autocast = torch.autocast("cpu", dtype=dtype) if dtype else contextlib.nullcontext()
    masked_rows = recipe.data.packs and traced_as == resolved  # sdpa and eager get a dense mask
    if recipe.data.packs and flash:
        batch, seq = 1, batch * seq  # the micro-batch flattened into one sequence (packing.py)
    with mode:
        inputs = _batch(batch, seq, recipe.data.packs, shape.padded)
        if facet is not None and not facet.dynamic_resolution:
            inputs |= _images(model.config, facet, inputs, images)
        elif facet is not None:
            inputs |= _image_features(model.config, inputs)
        counter = counter(peft_model)
        costs = RecomputeCost(counter)
        kernel_choice = _attention_kernels(shape.device, kernels)
        before_head = HeldBeforeHead(model, counter)
        with counter.counting(), costs.observing(), autocast, _no_packed_mask(not masked_rows), kernel_choice:
            # the output is kept to the block's end, where the count is fixed: its graph holds what was saved
            if uses_chunked_loss(recipe, config):  # the forward pass the chunked head runs, without labels
                outputs = final_hidden_states(
                    peft_model, {k: v for k, v in inputs.items() if k != "labels"}, model
                )
            else:
                with before_head:
                    outputs = peft_model(**inputs)
        del outputs
    per_layer = counter.result().per_layer
    names = [f"layer {i}" for i in range(len(decoder_layers(model)))]
    saved = {name: per_layer.get(name, 0) for name in [OUTSIDE, *names]}
    saved[BEFORE_HEAD] = before_head.held if before_head.held is not None else saved[OUTSIDE]
    return saved, {name: costs.of(name) for name in names}, experts


class RecomputeCost:
    """Counts, per layer, the cost of the ops selective checkpointing keeps and of those it recomputes, as
    the selective policy sees them in the forward pass (``selective.OBSERVERS``)."""

    def __init__(self, counter: SavedTensors) -> None:
        self.counter = counter  # its ``where`` names the layer running now
        self.kept: dict[str, float] = defaultdict(float)
        self.recomputed: dict[str, float] = defaultdict(float)

    @contextlib.contextmanager
    def observing(self):
        selective.OBSERVERS.append(self._observe)
        try:
            yield self
        finally:
            selective.OBSERVERS.remove(self._observe)

    def of(self, layer: str) -> tuple[float, float]:
        """(full, selective) recompute cost of a layer."""
        return self.kept[layer] + self.recomputed[layer], self.recomputed[layer]

    def _observe(self, func, args, kwargs, out, kept: bool) -> None:
        written = sum(
            t.numel() * t.element_size() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
        )
        packet = func._overloadpacket if hasattr(func, "_overloadpacket") else None
        flops = _flops(packet, args, kwargs, out)
        if (
            kept
            and func in selective.MATMULS
            and min(out.shape[-1], args[-1].shape[0]) >= selective.MIN_CONTRACTION
        ):
            written += args[-1].numel() * out.element_size()  # a 4-bit linear dequantizes its weight first
        (self.kept if kept else self.recomputed)[self.counter.where] += max(flops, BALANCE * written)


def _flops(packet, args, kwargs, out) -> float:
    """torch's FLOP count of an op, 0 where it has none. Before torch 2.12 the attention kernels' counts
    assert equal query and key/value heads, which grouped-query attention's flash call does not have:
    the op is then costed by the bytes it writes alone (the caller's max)."""
    if packet not in flop_registry:
        return 0
    try:
        return flop_registry[packet](*args, **kwargs, out_val=out)
    except AssertionError:
        return 0


@contextlib.contextmanager
def _no_packed_mask(active: bool):
    """Keep transformers from building a dense block-diagonal mask where the real run has none: rows that
    are not packed, and kernels that take packed sequences another way (flex's block mask, a flash
    kernel's sequence lengths). It finds packed rows by reading the position ids' values
    (``masking_utils.find_packed_sequence_indices``); fake tensors have none, so it would always build one."""
    if not active:
        yield
        return
    original = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def _fake_on_cpu(model: torch.nn.Module, mode: FakeTensorMode) -> None:
    cpu = torch.device("cpu")
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            fake = FakeTensor(mode, param.data, cpu)
            module._parameters[name] = torch.nn.Parameter(fake, requires_grad=param.requires_grad)
        for name, buffer in list(module.named_buffers(recurse=False)):
            module._buffers[name] = FakeTensor(mode, buffer, cpu)


def _placeholders_without_count_check(model) -> None:
    """A vision-language model checks that its image tokens are as many as its image features, a count of
    token values fake tensors do not have: in the trace, the placeholder mask is made as transformers
    makes it (the positions holding the image token), without the check. The meta model is the trace's
    own, so the instance is patched."""
    token = model.config.image_token_id
    language_model = model.model.language_model
    if hasattr(language_model, "_deepstack_process"):
        # Qwen3-VL adds the tower's DeepStack features into the first layers' states at the image
        # positions through a boolean index, whose size fake tensors cannot know. What it saves is those
        # positions' indices (16 bytes a position and DeepStack layer, no activation): left out.
        language_model._deepstack_process = lambda hidden_states, visual_pos_masks, visual_embeds: (
            hidden_states
        )
    if vision.vision_of(model.config).dynamic_resolution:  # Qwen-VL's: the image mask and the video one
        model.model.get_placeholder_mask = lambda input_ids, inputs_embeds, **_: (
            (input_ids == token).unsqueeze(-1),
            torch.zeros_like(input_ids, dtype=torch.bool).unsqueeze(-1),
        )
        return
    model.model.get_placeholder_mask = lambda input_ids, inputs_embeds, **_: (
        (input_ids == token).unsqueeze(-1).expand_as(inputs_embeds)
    )


def _image_features(config, inputs: dict[str, torch.Tensor]) -> dict:
    """A dynamic-resolution (Qwen-VL) batch's image features, handed to the model as its encoder's output
    and scattered into the embeddings as in a run; packed rows' positions as the collator makes them (the
    restarting text positions first, which build the packed mask, then the 3-D ones: their values change
    no shape). The tower itself is not traced: it reads its grid sizes as Python ints, which fake tensors
    have not, and frozen (LoRA on the language model) it keeps nothing for backward."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    ids = inputs["input_ids"]
    features = torch.zeros(ids.numel(), config.vision_config.out_hidden_size)  # at most every position
    encoded = BaseModelOutputWithPooling(pooler_output=[features])
    # Qwen3-VL's DeepStack: the tower's features of some of its layers, added into the language model's
    # first layers' states at the image positions (one tensor per such layer)
    deepstack = getattr(config.vision_config, "deepstack_visual_indexes", None)
    if deepstack:
        encoded.deepstack_features = [(features,)] * len(deepstack)  # per layer, split by image
    extra: dict = {"mm_encoder_outputs": {"image": encoded}}
    if "position_ids" in inputs:
        extra["position_ids"] = inputs["position_ids"][None].expand(4, -1, -1)
    return extra


def _images(config, facet, inputs: dict[str, torch.Tensor], per_row: int) -> dict[str, torch.Tensor]:
    """A vision-language batch's images at the vision tower's size, ``per_row`` a row, and Gemma-3's token
    types. What the vision tower keeps for backward is traced with them (only under lora.vision does it
    keep any: frozen, it has no gradient)."""
    rows = inputs["input_ids"].shape[0] * per_row
    side = config.vision_config.image_size
    images = {"pixel_values": torch.zeros(rows, getattr(config.vision_config, "num_channels", 3), side, side)}
    if facet.token_type_ids:
        images["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
    return images


def _attention_kernels(device: str, kernels: set[str]):
    """CUDA's attention kernel choice (``device_kernels``), or this CPU's own, named."""
    if device == "cuda":
        return device_kernels.cuda_attention(kernels)
    kernels.add("this CPU's sdpa kernel (torch's choice)")
    return contextlib.nullcontext()


def _batch(batch: int, seq: int, packing: bool, padded: bool = True) -> dict[str, torch.Tensor]:
    """What the collator hands the model: every position trained (the worst case the planner assumes);
    packed rows carry restarting position ids (two examples a row) and no attention mask."""
    ids = torch.zeros(batch, seq, dtype=torch.long)
    inputs = {"input_ids": ids, "labels": ids}
    if not packing and batch > 1 and padded:
        # (one row has no padding: transformers builds no mask for it, which long-context runs rely on)
        # The padding collator's mask. Of a batch of rows of one length transformers builds no attention
        # mask, of a padded batch one that attention keeps; it tells them apart by the mask's values,
        # which fake tensors do not have, so it builds one (``masking_utils._ignore_causal_mask_sdpa``):
        # the padded batch, the larger, is planned.
        inputs["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
    if packing:
        positions = torch.arange(seq).repeat(batch, 1)
        half = seq // 2
        positions[:, half:] -= half
        inputs["position_ids"] = positions
    return inputs
