"""The families table (registries/families.py): every family carries each facet a feature reads, and the
facets are true of the model transformers builds from the family's config."""

from __future__ import annotations

import inspect
import re

import pytest

from qlora_kit.registries import families
from qlora_kit.registries.families import FAMILIES, Gguf, NoExport


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_family_has_the_facets_the_features_read(model_type):
    from qlora_kit.after import gguf_families

    entry = FAMILIES[model_type]
    assert entry.model_type == model_type
    assert entry.tiny.startswith("tiny-") and entry.config_class  # model/builtin.py
    assert entry.linears and set(entry.attention_inputs) <= set(entry.linears)  # the planner's formula
    assert entry.mlp in (families.GATED, families.PLAIN)
    # export: a GGUF form whose writer and check exist, or a stated reason why there is none
    assert isinstance(entry.export, (Gguf, NoExport)), "a family says how it exports, or why it cannot"
    if isinstance(entry.export, NoExport):
        assert entry.export.reason.strip()
    else:
        assert entry.export.parameters in gguf_families.WRITERS
        assert entry.export.check is None or entry.export.check in gguf_families.CHECKS
        if entry.export.transformers_reads:  # what transformers' GGUF loader must be told
            assert ("attention.key_length", "head_dim") in entry.export.unmapped_keys
        assert entry.export.trained_layer_key.startswith("blk.")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_facets_hold_for_the_model_built_from_the_config(model_type):
    """The table's linears are the decoder layer's, its MLP width key names a width, and a family whose
    config routes tokens to experts says where its experts are."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from qlora_kit.memory.accounting import decoder_layers
    from qlora_kit.memory.shapes import intermediate_size
    from qlora_kit.model import moe_experts
    from qlora_kit.model.builtin import TINY_ARCHITECTURES, TINY_MOE_ARCHITECTURES, TINY_SHAPE
    from qlora_kit.model.layers import is_linear

    entry = FAMILIES[model_type]
    if entry.vision:  # the language model is a nested text config, the model its own auto class
        config = getattr(transformers, entry.config_class)(
            text_config={**TINY_SHAPE, **entry.tiny_config},
            vision_config=dict(entry.vision.tiny_vision_config),
            **entry.vision.tiny_model_config,
        )
        with torch.device("meta"):
            model = transformers.AutoModelForImageTextToText.from_config(config)
        assert {name for name, _ in model.model.named_children()} >= set(entry.vision.vision_modules)
        takes = inspect.signature(type(model).forward).parameters
        assert {*entry.vision.image_inputs, *(("token_type_ids",) * entry.vision.token_type_ids)} <= set(
            takes
        )
        config = config.get_text_config()
    else:
        builtins = TINY_MOE_ARCHITECTURES if entry.experts else TINY_ARCHITECTURES
        assert builtins[entry.tiny] == (entry.config_class, entry.tiny_config)
        config = getattr(transformers, entry.config_class)(**{**TINY_SHAPE, **entry.tiny_config})
        assert config.model_type == model_type
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    # a vision-language model's decoder is its language model (the vision tower has layers of its own)
    layers = decoder_layers(model.model.language_model if entry.vision else model)
    layer = layers[0]
    # the first layer's linears, then those each later layer adds (hybrid: linear and full attention; DeepSeek:
    # a dense first layer, then experts beside a shared expert)
    linears = (name for each in layers for name, m in each.named_modules() if is_linear(m))
    assert tuple(dict.fromkeys(linears)) == entry.linears
    routes = any(getattr(config, key, None) for key in families.EXPERT_COUNT_KEYS)
    assert routes == (entry.experts is not None), "a mixture-of-experts family needs its experts facet"
    if entry.experts is None:
        assert intermediate_size(config) in {w for m in layer.modules() if is_linear(m) for w in _sides(m)}
        return
    # the facet's router and experts are the first mixture layer's, and its keys count the experts and picks
    facet = entry.experts
    layer = next(
        each for each in layers if hasattr(each.get_submodule(facet.experts.rsplit(".", 1)[0]), "experts")
    )
    assert layer.get_submodule(facet.router).weight.shape == (
        getattr(config, facet.count_key),
        config.hidden_size,
    )
    experts, down = layer.get_submodule(facet.experts), getattr(config, facet.count_key)
    assert moe_experts.logical_shape(experts, "down_proj") == (
        down,
        config.hidden_size,
        getattr(config, entry.intermediate_key),
    )
    assert 0 < getattr(config, facet.active_key) < down


def _sides(module) -> tuple[int, int]:
    from qlora_kit.model.layers import features

    return features(module)


def test_a_family_without_a_gguf_form_is_refused_with_the_tables_reason():
    from types import SimpleNamespace

    from qlora_kit.after.gguf_families import family_of
    from qlora_kit.errors import ExportError

    for entry in FAMILIES.values():
        if isinstance(entry.export, NoExport):
            with pytest.raises(ExportError, match=re.escape(f"not supported: {entry.export.reason}")):
                family_of(SimpleNamespace(model_type=entry.model_type))
