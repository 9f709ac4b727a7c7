"""Layers that carry a state along the sequence (Gated DeltaNet in Qwen3.5 and Qwen3-Next, Mamba, short
convolutions), and why a packed row cannot keep its examples apart in them here.

Attention keeps packed examples apart by its mask or its sequence boundaries. A linear-attention layer
does not attend: it updates one recurrent state token by token (and its short convolution mixes each
token with the three before it), so an example packed after another starts from the state the other
left. transformers 5.24 keeps them apart only through the CUDA kernels of flash-linear-attention and
causal-conv1d, fed a flattened row's ``cu_seq_lens`` and ``seq_idx``; its PyTorch path raises on those
boundaries, and without them it runs the state on. Measured on the tiny Qwen3.5 and Qwen3.5-MoE
(tests/test_hybrid.py): the second example's logits move by ~0.25 when packed behind the first, against
~6e-7 for the same models with attention layers only. So packing is refused for such a model, and
``data.packing: auto`` does not pack.
"""

from __future__ import annotations

# layer_types values whose layers attend under a mask or window (packing keeps examples apart in them)
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
# model types made only of recurrent layers (no layer_types in their configs)
RECURRENT_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"})


def recurrent_layer_types(config) -> tuple[str, ...]:
    """The kinds of ``config``'s decoder layers that carry a state along the sequence (() for none)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "model_type", None) in RECURRENT_MODEL_TYPES:
        return (text.model_type,)
    kinds = getattr(text, "layer_types", None) or ()
    return tuple(dict.fromkeys(k for k in kinds if k not in ATTENTION_LAYER_TYPES))


def recurrent_layers(config, count: int) -> frozenset[int]:
    """The indices of ``config``'s ``count`` decoder layers that carry a state along the sequence: the layers
    of a recurrent kind in ``layer_types``, or every layer of a model made only of recurrent layers."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "model_type", None) in RECURRENT_MODEL_TYPES:
        return frozenset(range(count))
    kinds = getattr(text, "layer_types", None) or ()
    return frozenset(i for i, kind in enumerate(kinds[:count]) if kind not in ATTENTION_LAYER_TYPES)


def packing_refusal(config) -> str | None:
    """Why rows of this model cannot be packed (None: they can)."""
    kinds = recurrent_layer_types(config)
    if not kinds:
        return None
    model_type = getattr(config, "model_type", "this model")
    return (
        f"{model_type}'s {' and '.join(kinds)} layers carry a recurrent state from one packed example into "
        "the next (only attention keeps packed examples apart)"
    )
