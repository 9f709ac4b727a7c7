"""The tiny random models of benchmarks/families_matrix.py: any causal LM of transformers' auto mapping, built
from its own config at a tiny shape, saved with the builtin tokenizer into a folder a recipe can name.

The shape is set under transformers' common names (``hidden_size``, ``num_attention_heads``...) wherever a
config has them, in its own names where it maps them (``n_embd``, ``d_model``); a mixture's counts and
widths are capped; a hybrid gets as many layers as its pattern needs to hold each kind once. ``OVERRIDES``
holds what a few configs need beyond that, ``NOT_RUN`` the types the table does not run, and why;
``not_decoder_only`` says why a type is not a decoder-only text model (encoder-decoders, encoders,
vision or audio models qlora_kit has no builtin processor for).
"""

from __future__ import annotations

from pathlib import Path

# the tiny shape, under transformers' common names (a config maps them onto its own: n_embd, d_model...)
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
# where a config has them, at most these: a mixture's widths and counts (a default of 256 experts of 2,048
# would be most of the model's bytes), its dense layers before the first mixture, a partial rotary width
AT_MOST = {
    "moe_intermediate_size": 64,
    "expert_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "rotary_dim": 8,
}
# per model_type, what its config needs beyond these to build a model like its checkpoints: where
# transformers' default config builds no model (experts, layer kinds or rope left unset) or builds one
# its checkpoints are not (Bamba's and Zamba's without attention layers), or its own sizes disagree
OVERRIDES: dict[str, dict] = {
    "bamba": {"attn_layer_indices": [1]},
    "cohere_compass_text": {
        "rope_parameters": {
            kind: {"rope_type": "default", "rope_theta": 10000.0}
            for kind in ("full_attention", "sliding_attention")
        }
    },
    "dbrx": {
        "attn_config": {"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 1},
    },
    "deepseek_v2": {"num_experts_per_tok": 2},  # its config's default is None, a checkpoint's 6
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    # its last layers reuse the key/value cache of earlier ones of their kind: two patterns of 4 + 1
    "gemma3n_text": {"num_hidden_layers": 10, "num_kv_shared_layers": 5, "vocab_size_per_layer_input": 1024},
    # Granite-4.0-H mixes Mamba and attention layers; the config's default is Mamba alone
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "mamba2": {"num_heads": 4, "head_dim": 32, "n_groups": 1},  # expand x hidden = heads x head size
    # its indexed-attention layers' token indexer (QSA), which the default config leaves unset
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 256,  # its rotary width (head_dim 256) must fit an index head
        "indexer_budget": 16,
        "indexer_compress_ratio": 4,
    },
    "zamba": {"num_hidden_layers": 8},  # two of its shared-transformer layers (they share their weights)
}
# model_types the auto mapping lists that this table does not run, and why
NOT_RUN = {
    "blt": "not a token-level model: BLT reads bytes through an entropy patcher of its own (no tokenizer "
    "but its 260 bytes fits it)",
    "trocr": "not a decoder-only text model: the text decoder of VisionEncoderDecoderModel (it attends to an image encoder)",
    "gemma4_assistant": "not a standalone model: a Gemma 4 drafter (its layers read the target model's key/value cache)",
    "gemma4_unified_assistant": "not a standalone model: a Gemma 4 drafter (its layers read the target model's key/value cache)",
}
EXTRA_ROWS = 64  # embedding rows past the tokenizer's (a model's tokenizer class may add its own tokens)


def not_decoder_only(model_type: str) -> str | None:
    """Why ``model_type`` is not a decoder-only text model qlora_kit could be asked to train, or None."""
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto as auto

    from qlora_kit.registries import families

    if model_type in NOT_RUN:
        return NOT_RUN[model_type]
    config = AutoConfig.for_model(model_type)
    if (
        getattr(config, "is_encoder_decoder", False)
        or model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    ):
        return "not a decoder-only text model: the decoder half of an encoder-decoder model"
    if model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return "not a decoder-only text model: an encoder (masked LM) with a decoder mode"
    other = sorted(
        name for name in getattr(config, "sub_configs", {}) or {} if name != "text_config" and _media(name)
    )
    media = other or model_type in auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    if media and families.family(model_type) is None:
        text = config.get_text_config().model_type
        also = f"; its text model is {text}" if text != model_type else ""
        return f"not a decoder-only text model: {', '.join(other) or 'images'} in its config, no builtin processor{also}"
    return None


def _media(name: str) -> bool:
    return any(word in name for word in ("vision", "audio", "image", "vq", "speech"))


def tiny_config(model_type: str, vocab: int, tokenizer):
    """``model_type``'s config at the tiny shape (only the keys its config has; a multimodal config's text
    config takes them)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    text = default.get_text_config()
    if getattr(text, "is_heterogeneous", False):
        text.allow_global_per_layer_attribute_access = True  # sized per layer: qlora_kit refuses it at load
    overrides = OVERRIDES.get(model_type, {})
    layers = overrides.get("num_hidden_layers", SHAPE["num_hidden_layers"])
    values = {**tiny_values(text, layers), "vocab_size": vocab}
    if _settable(text, "unpadded_vocab_size"):  # the rows it pads to vocab_size (Inkling's)
        values["unpadded_vocab_size"] = vocab
    # under the config's own names (n_embd, d_model): what its __post_init__ reads
    own = getattr(text, "attribute_map", {})
    values = {**{own.get(key, key): value for key, value in values.items()}, **overrides}
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if text is default:
        return AutoConfig.for_model(model_type, **values, **ids)
    return AutoConfig.for_model(model_type, text_config={**values, **ids}, **ids)


def tiny_values(text, layers: int = SHAPE["num_hidden_layers"]) -> dict:
    """The tiny shape in the keys ``text`` (a default config) has. Attention keeps its kind (one key/value
    head per query head, one for all, or 2 for 4); a head size the hidden size derives (or left unset)
    keeps deriving; a hybrid (``layer_types``: sliding and full attention, linear and full...) gets as
    many layers as its pattern needs to hold each kind of layer once (at least ``layers``)."""
    values = {key: value for key, value in SHAPE.items() if _settable(text, key)}
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None)
    if heads and _settable(text, "num_key_value_heads"):  # None: as many as the query heads
        values["num_key_value_heads"] = (
            SHAPE["num_attention_heads"] if kv in (heads, None) else 1 if kv == 1 else 2
        )
    for key in ("head_dim", "d_head"):
        size = getattr(text, key, 0)
        if heads and _settable(text, key) and (size is None or size * heads == text.hidden_size):
            values[key] = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    for key, most in AT_MOST.items():
        value = getattr(text, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and _settable(text, key):
            values[key] = min(value, most)
    kinds, key = _layer_kinds(text)
    if kinds and "num_hidden_layers" in values:
        values["num_hidden_layers"] = max(layers, *(kinds.index(kind) + 1 for kind in set(kinds)))
        if _settable(text, key):  # a list of its own (else a property of the layer count)
            values[key] = kinds[: values["num_hidden_layers"]]
    return values


def _layer_kinds(config) -> tuple[list, str]:
    """The config's kind of each layer, and the key that holds them."""
    kinds = getattr(config, "layer_types", None)
    return (list(kinds) if isinstance(kinds, (list, tuple)) else []), "layer_types"


def _settable(config, key: str) -> bool:
    """``config`` has ``key`` (itself or through its attribute_map) and it is not a computed property."""
    if not hasattr(config, key):
        return False
    name = getattr(config, "attribute_map", {}).get(key, key)
    return not isinstance(getattr(type(config), name, None), property)


def build_model(model_type: str, folder: Path) -> Path:
    """A random-weight tiny ``model_type`` with the builtin tokenizer, saved into ``folder``; a family with a
    vision facet is its builtin (model/builtin_vision.py: the processor built offline)."""
    import torch
    import transformers

    from qlora_kit.model import builtin, builtin_vision
    from qlora_kit.registries import families

    entry = families.family(model_type)
    if entry is not None and entry.vision is not None:
        return builtin_vision.ensure_tiny_vlm(entry.tiny)
    tokenizer = builtin.build_tokenizer()
    tokenizer.save_pretrained(folder)
    config = tiny_config(model_type, len(tokenizer) + EXTRA_ROWS, tokenizer)
    config.save_pretrained(folder)  # AutoTokenizer reads model_type: some classes add tokens of their own
    loaded = len(transformers.AutoTokenizer.from_pretrained(folder))
    if loaded > config.get_text_config().vocab_size:
        raise ValueError(f"{model_type}'s tokenizer class has {loaded} tokens, past the embedding rows")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return folder
