"""Every default holds on every kind of model the families table holds (dense, mixture of experts,
vision-language): a recipe that names only the model validates, plans, and gets a LoRA config peft
takes, so no two defaults contradict each other on one kind (issue 58: lora.dropout 0.05 against
lora.experts on every mixture). Fast: the models are built on the meta device, nothing loads."""

from __future__ import annotations

import pytest
import torch
import transformers

from qlora_kit import Recipe
from qlora_kit.memory.planner import plan
from qlora_kit.model import adapters, builtin
from qlora_kit.registries.families import FAMILIES, by_tiny_name

KINDS = {
    f.tiny: "vision-language" if f.vision else "mixture" if f.experts else "dense" for f in FAMILIES.values()
}


def meta_model(recipe: Recipe):
    """The builtin's model, its layers and parameters as they load, on the meta device (no weights)."""
    from qlora_kit.memory.shapes import model_shape

    config = model_shape(recipe).config
    with torch.device("meta"):
        if KINDS[recipe.model.path.removeprefix("builtin:")] == "vision-language":
            return transformers.AutoModelForImageTextToText.from_config(config)
        return transformers.AutoModelForCausalLM.from_config(config)


# The fast tier keeps one builtin of each kind (and the vision-language mixture, whose LoRA follows its
# experts); the other builtins' plans trace for a second or more each and run in the full suite.
FAST_TIER = {"tiny-llama", "tiny-qwen3-moe", "tiny-qwen2.5-vl", "tiny-qwen3-vl-moe"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=() if n in FAST_TIER else pytest.mark.slow) for n in sorted(KINDS)],
    ids=lambda n: f"{KINDS[n]}:{n}",
)
def test_a_recipe_naming_only_the_model_validates_plans_and_configures_lora(name):
    recipe = Recipe.from_dict({"model": {"path": f"builtin:{name}"}})
    planned = plan(recipe)
    assert planned.policies and all(p.peak > p.activations > 0 for p in planned.policies)
    config = adapters.lora_config(recipe.lora, meta_model(recipe))
    mixture = by_tiny_name(name).experts is not None  # a vision-language mixture too (Qwen3-VL-MoE)
    # auto dropout: none where the experts take LoRA (peft refuses it there), 0.05 everywhere else
    assert config.lora_dropout == (0.0 if mixture else recipe.lora.AUTO_DROPOUT)
    assert bool(config.target_parameters) == mixture


def test_every_kind_is_covered():
    assert set(KINDS.values()) == {"dense", "mixture", "vision-language"}
    assert {KINDS[name] for name in FAST_TIER} == set(KINDS.values())  # the fast tier too
    assert set(builtin.TINY_MOE_ARCHITECTURES) <= set(KINDS)


@pytest.mark.parametrize("dropout", [0.05, 0.1])
def test_dropout_given_on_a_mixtures_experts_is_one_line_naming_both_fields(dropout):
    recipe = Recipe.from_dict({"model": {"path": "builtin:tiny-qwen3-moe"}, "lora": {"dropout": dropout}})
    with pytest.raises(Exception, match=r"^lora\.dropout: .*lora\.experts"):
        adapters.lora_config(recipe.lora, meta_model(recipe))
    # with the experts left out, the dropout the user asked for is theirs
    recipe = recipe.with_overrides({"lora.experts": False})
    assert adapters.lora_config(recipe.lora, meta_model(recipe)).lora_dropout == dropout
