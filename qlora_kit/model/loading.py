"""Model stage: the tokenizer and the base causal LM with its linear weights quantized to 4 bits.

Quantization goes through transformers' ``BitsAndBytesConfig``: every ``nn.Linear`` in the decoder
becomes a ``bitsandbytes.nn.Linear4bit`` holding packed NF4/FP4 weights (blocks of 64 values, one
absmax each, the absmax themselves 8-bit quantized with double quantization). Embeddings, norms and
the output head stay in ``quant.compute_dtype``. A mixture of experts' fused 3-D expert weights, which
bitsandbytes does not see, are packed into 4 bits by ``moe_experts.quantize_experts``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import bitsandbytes as bnb
import torch
from accelerate import PartialState
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    BitsAndBytesConfig,
)

from qlora_kit.errors import RecipeError
from qlora_kit.model import (
    bnb_selftest,
    builtin,
    builtin_vision,
    experts_selfcheck,
    hub,
    layer_sizes,
    moe_experts,
    mxfp4,
    pretrained,
    text_only,
    vision,
)
from qlora_kit.model.layers import is_linear
from qlora_kit.model.paths import check_model_folder, first_line
from qlora_kit.registries import attention, families, family_traits

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from qlora_kit.recipe.recipe import ModelSection, QuantSection

log = logging.getLogger(__name__)


def resolve_model_path(model: ModelSection) -> str:
    """A local folder or hub id; builtin names are built (once) into the cache first."""
    if builtin.is_builtin(model.path):
        name = builtin.builtin_name(model.path)
        if name in pretrained.PRETRAINED:
            return str(pretrained.ensure_pretrained(name, builtin.cache_root()))
        if name in builtin_vision.TINY_VISION_ARCHITECTURES:
            return str(builtin_vision.ensure_tiny_vlm(name))
        return str(builtin.ensure_tiny_model(name))
    local = Path(model.path).expanduser()
    return str(local) if local.exists() else model.path  # a hub id stays as it is


def load_tokenizer(model: ModelSection, path: str | None = None) -> PreTrainedTokenizerBase:
    field = "--adapter"  # the tokenizer saved beside an adapter
    if path is None:
        path, field = resolve_model_path(model), "model.path"
        check_model_folder(path, weights=False)
    with _model_path_errors(path, field, model.revision):
        tokenizer = AutoTokenizer.from_pretrained(
            path, trust_remote_code=model.trust_remote_code, revision=model.revision
        )
    check_vocab_fits(tokenizer, model, field)
    if tokenizer.pad_token is None:
        # Llama-style tokenizers ship without a pad token. Padded label positions are -100 anyway
        # (see data/prepare.build_collator), so reusing EOS for padding never hides a real EOS from the loss.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_config(model: ModelSection):
    """The transformers config (no weights) of the model qlora_kit builds (a multimodal checkpoint's language
    model alone: its text config, text_only.py)."""
    path = resolve_model_path(model)
    with _model_path_errors(path, revision=model.revision):
        config = AutoConfig.from_pretrained(
            path, trust_remote_code=model.trust_remote_code, revision=model.revision
        )
    return text_only.language_model_config(config)


def check_loadable_in_4_bits(config, quant: QuantSection) -> None:
    """RecipeError in one line for an architecture that writes into a linear layer's weight in its forward
    pass (``family_traits.WEIGHTS_WRITTEN_IN_FORWARD``): at 4 bits that weight is packed uint8."""
    model_type = config.get_text_config().model_type
    why = family_traits.WEIGHTS_WRITTEN_IN_FORWARD.get(model_type)
    if why is not None and quant.bits == 4:
        raise RecipeError(
            f"model.path: {model_type} cannot load in 4 bits: {why}, which a 4-bit weight cannot take "
            "(quant.bits 16 loads it in 16 bits)"
        )


def check_has_attention(config) -> None:
    """RecipeError in one line for a model without attention layers (Mamba, RWKV, xLSTM: its config names no
    attention heads): the attention memory check and the planner size every layer's attention by its heads."""
    text = config.get_text_config()
    if getattr(text, "num_attention_heads", None) is None:
        raise RecipeError(
            f"model.path: {text.model_type} has no attention layers (a state-space or recurrent model: its config "
            "names no num_attention_heads), which qlora_kit's memory checks and planner do not size yet"
        )


def check_checkpointable(base: PreTrainedModel) -> None:
    """RecipeError in one line for a model whose transformers code cannot checkpoint its layers
    (``supports_gradient_checkpointing`` False: CTRL, OpenAI GPT, XLNet, JetMoe): qlora_kit's memory
    policies checkpoint decoder layers through transformers (``activation_checkpointing_enable``), and its
    planner and per-layer counts find them as the GradientCheckpointingLayer that code of this kind has not."""
    if not base.supports_gradient_checkpointing:
        raise RecipeError(
            f"model.path: {base.config.model_type}'s transformers code ({type(base).__name__}) does not support "
            "activation checkpointing, which qlora_kit's memory policies, planner and per-layer counts are built on"
        )


def check_quantized(base: PreTrainedModel, facet=None) -> None:
    """RecipeError in one line when 4-bit loading quantized none of the model's linear layers: transformers'
    bitsandbytes integration replaces a layer whose type is ``nn.Linear`` itself (or GPT-2's Conv1D), never a
    model's own subclass of it (Falcon's FalconLinear; integrations/bitsandbytes.py,
    ``replace_with_bnb_linear``), and LoRA would then train over 16-bit weights. The output head and a
    vision-language model's vision side (``facet``) stay in 16 bits by design."""
    if bnb_selftest.four_bit_widths(base):
        return
    head = base.get_output_embeddings()
    kinds = sorted(
        {
            type(m).__name__
            for name, m in base.named_modules()
            if is_linear(m) and m is not head and not vision.on_vision_side(name, facet)
        }
    )
    if kinds:
        raise RecipeError(
            f"model.path: 4-bit loading quantized none of {base.config.model_type}'s linear layers "
            f"({', '.join(kinds)}): transformers' bitsandbytes integration replaces torch.nn.Linear itself, not a "
            "model's own subclass of it, so LoRA would train over 16-bit weights (quant.bits 16 loads it so knowingly)"
        )


def vision_facet(model: ModelSection):
    """The families table's vision facet of the model (its config read, no weights), or None: text-only."""
    return vision.vision_of(load_config(model))


def load_processor(model: ModelSection):
    """A vision-language model's processor (image processor, tokenizer, chat template) and its families-table
    vision facet, or None for a text-only model (vision.py)."""
    facet = vision_facet(model)
    if model.max_pixels is not None and not (facet and facet.dynamic_resolution):
        raise RecipeError(
            f"model.max_pixels: {model.path} does not resize images by their pixel count (only a "
            "dynamic-resolution family such as Qwen-VL does); remove it"
        )
    if facet is None:
        return None
    path = resolve_model_path(model)
    with _model_path_errors(path, revision=model.revision):
        processor = vision.load_processor(
            path, model.trust_remote_code, model.revision, facet, max_pixels=model.max_pixels
        )
        return processor, facet


def check_vocab_fits(
    tokenizer: PreTrainedTokenizerBase, model: ModelSection, field: str = "model.path"
) -> None:
    """A tokenizer whose ids reach past the model's embedding rows (special tokens added without resizing)
    would fail as an index error in the first forward pass: one line now, before any weight is loaded."""
    path = resolve_model_path(model)
    with _model_path_errors(path, revision=model.revision):
        config = AutoConfig.from_pretrained(
            path, trust_remote_code=model.trust_remote_code, revision=model.revision
        )
    rows = getattr(config.get_text_config(), "vocab_size", None)
    if rows is not None and len(tokenizer) > rows:
        raise RecipeError(
            f"{field}: the tokenizer has {len(tokenizer):,} tokens but the model's embeddings have {rows:,} rows "
            f"(ids {rows:,}-{len(tokenizer) - 1:,} have no embedding); use the tokenizer the model was trained "
            "with, or resize the embeddings (model.resize_token_embeddings(len(tokenizer))) and save the model "
            "before fine-tuning it"
        )


def bnb_config(quant: QuantSection, skip: list[str] | None = None):
    """transformers' BitsAndBytesConfig for the recipe; ``skip``: modules left in 16 bits (a
    vision-language model's vision side: vision.py)."""
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant.quant_type,
        bnb_4bit_use_double_quant=quant.double_quant,
        bnb_4bit_compute_dtype=getattr(torch, quant.compute_dtype),
        bnb_4bit_quant_storage=getattr(torch, quant.quant_storage),
        llm_int8_skip_modules=skip,
    )


def load_base_model(
    model: ModelSection, quant: QuantSection, path: str | None = None, experts_to_host: Callable | None = None
) -> PreTrainedModel:
    """The base model with 4-bit linear layers (or in compute_dtype with quant.bits 16), on this process's
    GPU when there is one, otherwise on the CPU.

    ``experts_to_host(model, device=...)`` (memory.experts_on_host's keep_experts_on_host): the model is
    loaded and its experts packed on the host, that function keeps the experts there, and only then does
    the rest of the model go to the device: no expert's bytes, 16-bit or packed, are ever on the device at
    load. Any other mixture at 4 bits on a GPU is loaded and packed on the host too, then moved whole
    (``packs_on_host_first``): transformers' device map would put its experts on the GPU in 16 bits first.

    Under FSDP too every process loads and quantizes the whole model onto its own device, and FSDP
    shards it when the Trainer prepares it (freeing the rest): transformers 5.24 loads on rank 0 alone
    (``cpu_ram_efficient_loading``) only models that are not quantized (modeling_utils,
    ``_move_missing_keys_from_meta_to_device``), so the whole 4-bit model must fit one GPU while it loads.
    """
    if model.trust_remote_code:
        log.warning("model.trust_remote_code is on: code shipped with %s will run", model.path)
    path = path or resolve_model_path(model)
    check_model_folder(path)
    with _model_path_errors(path, revision=model.revision):
        checkpoint = AutoConfig.from_pretrained(
            path, trust_remote_code=model.trust_remote_code, revision=model.revision
        )
    config = text_only.language_model_config(checkpoint)
    layer_sizes.check_layers_counted(config)
    check_has_attention(config)
    check_loadable_in_4_bits(config, quant)
    kernel = _attention_kernel(model.attn_implementation, config)
    with _model_path_errors(path, revision=model.revision):
        if mxfp4.is_mxfp4(config):  # the released gpt-oss: dequantized once, then loaded as 16-bit weights
            path = mxfp4.dequantized_folder(path, model.revision, model.trust_remote_code)
        language_model_alone = config if text_only.alone(checkpoint) else None
        cuda = torch.cuda.is_available()
        host_first = experts_to_host is not None or packs_on_host_first(config, quant.bits, cuda)
        placement = {"": "cpu"} if host_first else device_map()
        base = _from_pretrained(
            model, quant, path, kernel, vision.vision_of(config), language_model_alone, placement
        )
    if language_model_alone is not None:
        text_only.mark_loaded_alone(base, checkpoint)
    check_checkpointable(base)
    disable_cpu_weight_repacking(base)
    compute_dtype = getattr(torch, quant.compute_dtype)
    if quant.bits == 4 and moe_experts.quantize_experts(
        base, compute_dtype, quant.quant_type, quant.double_quant
    ):
        experts_selfcheck.check(base)  # the layout read from the module, against the model's own forward
        log.info(
            "experts: every expert in 4 bits (%s, double quant %s), checked against transformers' eager "
            "forward within %.2g",
            quant.quant_type,
            quant.double_quant,
            experts_selfcheck.tolerance(compute_dtype),
        )
    if host_first:
        _to_device_but_experts(base, experts_to_host)
    if quant.bits == 4:  # bitsandbytes checked on this device before its weights are used (bnb_selftest.py)
        check_quantized(base, vision.vision_of(config))
        bnb_selftest.guard(base)
    log.info("weights by kind: %s", moe_experts.describe_sizes(moe_experts.bytes_by_kind(base)))
    if kernel is not None and base.config._attn_implementation != kernel:
        # A config.json carrying "_attn_implementation" wins over from_pretrained's argument (transformers
        # 5.24); the recipe's kernel is the one that runs, always.
        base.set_attn_implementation(kernel)
    log.info(
        "attention: %s (model.attn_implementation: %s)",
        base.config._attn_implementation,
        model.attn_implementation,
    )
    # the KV cache is useless in training and conflicts with checkpointing; with one, transformers also
    # stops finding packed rows' examples in their position ids. A vision-language model's language model
    # reads its own (nested) text config.
    for config in {id(c): c for c in (base.config, base.config.get_text_config())}.values():
        config.use_cache = False
    return base


@contextlib.contextmanager
def _model_path_errors(path: str, field: str = "model.path", revision: str | None = None):
    """What transformers raises for a folder it cannot load (OSError, a conversion ValueError, a damaged
    safetensors file) or a hub download that failed becomes one line naming the field; the original
    stays chained for debugging."""
    try:
        yield
    except (OSError, ValueError, SafetensorError) as exc:
        line = hub.explain_model_failure(exc, field, path, revision)
        raise RecipeError(line or f"{field}: cannot load {path} ({first_line(exc)[:300]})") from exc


def _attention_kernel(name: str, config) -> str | None:
    try:
        return attention.resolve(name, config)
    except ValueError as exc:  # the architecture does not support the recipe's kernel
        raise RecipeError(str(exc)) from None


def _from_pretrained(
    model: ModelSection,
    quant: QuantSection,
    path: str,
    kernel: str | None,
    facet=None,
    text_config=None,
    placement: dict[str, int | str] | None = None,
) -> PreTrainedModel:
    """``text_config``: a multimodal checkpoint's language model is built from it and loaded alone;
    ``placement``: transformers' device map (``device_map()`` unless given)."""
    # a vision-language model: its own auto class, the vision side left in 16 bits unless asked (vision.py)
    auto = AutoModelForImageTextToText if facet else AutoModelForCausalLM
    skip = vision.skipped_modules(facet, quant.vision) if facet else None
    settings = dict(
        quantization_config=bnb_config(quant, skip) if quant.bits == 4 else None,
        dtype=getattr(torch, quant.compute_dtype),
        device_map=placement or device_map(),
        trust_remote_code=model.trust_remote_code,
        revision=model.revision,
        # always the recipe's kernel: a config.json naming one would otherwise choose it silently
        attn_implementation=kernel,
    )
    if text_config is None:
        return auto.from_pretrained(path, **settings)
    with text_only.towers_left_unread():
        base, info = auto.from_pretrained(path, config=text_config, output_loading_info=True, **settings)
    text_only.check_loaded(info, path, text_config.model_type)
    return base


def device_map() -> dict[str, int | str]:
    """The whole model on this process's GPU (its local rank under a multi-process launch), else the CPU."""
    if torch.cuda.is_available():
        # One process per GPU under accelerate/torchrun: each rank loads onto its own device.

        return {"": PartialState().local_process_index}
    return {"": "cpu"}


def packs_on_host_first(config, bits: int, cuda: bool) -> bool:
    """Whether the model is loaded on the host and its experts packed there before it goes to the GPU: a
    mixture at 4 bits. Its fused experts are parameters bitsandbytes does not quantize, so transformers'
    device map would put every expert on the GPU in 16 bits before ``quantize_experts`` packs them (a
    30B-A3B: ~57 GB, where the packed model is ~17): the host holds them in 16 bits instead, for the load."""
    mixture = families.experts_facet(config) is not None or config.model_type in families.FLAT_EXPERTS
    return cuda and bits == 4 and mixture


def _to_device_but_experts(base: PreTrainedModel, experts_to_host: Callable | None) -> None:
    """The model loaded on the host, its experts packed: the experts kept there by ``experts_to_host`` (their
    tensors swapped for empty ones on the device) where given, then the rest moved to the device. Not
    transformers' device map with the experts on "cpu": accelerate would offload them with its own hooks,
    moving each whole module at every call, and refuse to train a 4-bit model so placed."""
    placement = device_map()
    device = torch.device("cuda", placement[""]) if torch.cuda.is_available() else torch.device("cpu")
    if experts_to_host is not None:
        experts_to_host(base, device=device)
    base.to(device)  # the experts' empty tensors are there already: nothing of theirs moves
    base.hf_device_map = placement  # where it is now, which accelerate reads before training it


def disable_cpu_weight_repacking(model: PreTrainedModel) -> int:
    """Stop bitsandbytes from repacking 4-bit weights for its CPU inference kernel.

    On CPUs with AVX512-BF16, ``Linear4bit.forward`` in eval mode without grad (what the Trainer's
    evaluation does) repacks the weight in place for a faster kernel. Training afterwards gets wrong
    input gradients silently, and merging reads garbage. See bitsandbytes' ``Linear4bit.forward``
    (``_convert_weight_packed_for_cpu``). Returns how many layers were changed.
    """

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for layer in layers:
        layer.support_avx512bf16_for_cpu = False
    return len(layers)
