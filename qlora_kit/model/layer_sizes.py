"""Sizes that differ from one decoder layer to the next.

transformers' heterogeneous configs override attributes layer by layer (``per_layer_config``) and raise on
reading such an attribute once for the whole model. Gemma 4 is one: its full-attention layers have heads of
512 where its sliding-window layers have 256, and in its larger models a number of key/value heads of their
own. qlora_kit reads these two layer by layer (``COUNTED_PER_LAYER``): the FLOP count
(training/watch/throughput.py), the planner's traced layers (memory/tracing.py: a layer's kind is its type,
its sizes and whether it reuses an earlier layer's keys and values) and its formula fallback (sized at the
widest layer). A config that sets any other attribute layer by layer is refused in one line.
"""

from __future__ import annotations

from typing import Any

from qlora_kit.errors import RecipeError

COUNTED_PER_LAYER = frozenset({"head_dim", "num_key_value_heads"})


def is_heterogeneous(text) -> bool:
    return bool(getattr(text, "is_heterogeneous", False))


def layer_sizes(text, index: int) -> dict[str, Any]:
    """Layer ``index``'s own values of the attributes its config sets layer by layer ({} for a config
    that sets none)."""
    if not is_heterogeneous(text):
        return {}
    layer = text.per_layer_config[index]
    return {name: getattr(layer, name) for name in sorted(text.per_layer_attributes)}


def _layer_config(text, index: int):
    return text.per_layer_config[index] if is_heterogeneous(text) else text


def head_dims(text) -> list[int]:
    """Each decoder layer's attention head size (``head_dim``, else hidden / heads)."""
    sizes = []
    for index in range(text.num_hidden_layers):
        layer = _layer_config(text, index)
        sizes.append(getattr(layer, "head_dim", None) or layer.hidden_size // layer.num_attention_heads)
    return sizes


def kv_heads(text) -> list[int]:
    """Each decoder layer's number of key/value heads (all of its query heads where the config names none)."""
    return [
        getattr(layer, "num_key_value_heads", None) or layer.num_attention_heads
        for layer in (_layer_config(text, index) for index in range(text.num_hidden_layers))
    ]


def kv_reused(text) -> list[bool]:
    """Which decoder layers read an earlier layer's keys and values instead of computing their own (Gemma 4's
    last ``num_kv_shared_layers``)."""
    shared = getattr(text, "num_kv_shared_layers", 0) or 0
    return [index >= text.num_hidden_layers - shared for index in range(text.num_hidden_layers)]


def check_layers_counted(config) -> None:
    """RecipeError in one line for a config that sets an attribute layer by layer that qlora_kit reads once
    for the whole model (everything but ``COUNTED_PER_LAYER``)."""
    text = config.get_text_config()
    if not is_heterogeneous(text):
        return
    uncounted = sorted(set(text.per_layer_attributes or ()) - COUNTED_PER_LAYER)
    if uncounted:
        raise RecipeError(
            f"model.path: {text.model_type} sets {', '.join(uncounted)} layer by layer (per_layer_config), "
            f"which qlora_kit reads once for every layer (it reads only {', '.join(sorted(COUNTED_PER_LAYER))} "
            "layer by layer)"
        )
