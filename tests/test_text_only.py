"""A multimodal checkpoint's language model, loaded alone (model/text_only.py): Gemma 4's released checkpoints
are its vision-and-audio-language model, whose weights name the language model ``model.language_model.*``.
qlora_kit builds Gemma4ForCausalLM from the text config, reads those weights under their own names and leaves
the towers unread; the planner plans that same model."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from safetensors.torch import load_file

from qlora_kit import Recipe
from qlora_kit.errors import RecipeError
from qlora_kit.memory.shapes import model_shape
from qlora_kit.model import builtin, text_only
from qlora_kit.model import loading as model
from qlora_kit.registries import families

from .conftest import DEMO


@pytest.fixture(scope="module")
def multimodal_gemma4(tmp_path_factory):
    """A tiny Gemma 4 checkpoint as Google ships them: the language model (the builtin's shape, embeddings
    tied) with a vision and an audio tower, saved by Gemma4ForConditionalGeneration."""
    text = {
        **builtin.TINY_SHAPE,
        **families.family("gemma4_text").tiny_config,
        "vocab_size": 640,
        "tie_word_embeddings": True,
    }
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2}
    audio = {"hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=audio)
    folder = tmp_path_factory.mktemp("gemma4-multimodal")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        whole = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert type(whole).__name__ == "Gemma4ForConditionalGeneration"
    whole.save_pretrained(folder)
    builtin.build_tokenizer().save_pretrained(folder)
    return folder


def recipe_on(folder) -> Recipe:
    return Recipe.from_yaml(
        DEMO,
        overrides={"model.path": str(folder), "quant.bits": 16, "quant.compute_dtype": "float32"},
    )


def test_the_language_model_loads_alone_with_the_checkpoints_own_weights(multimodal_gemma4, caplog):
    """Every language model tensor equals the checkpoint's ``model.language_model.*`` one (red without the
    renaming: transformers would build them at random, or the whole multimodal model would load), no tower
    is built, and the load report's hundreds of unread tower weights are not printed."""
    recipe = recipe_on(multimodal_gemma4)
    with caplog.at_level(logging.WARNING):
        base = model.load_base_model(recipe.model, recipe.quant)
    assert type(base).__name__ == "Gemma4ForCausalLM"
    assert "LOAD REPORT" not in caplog.text
    saved = load_file(multimodal_gemma4 / "model.safetensors")
    prefix = "model.language_model."
    language = {
        "model." + key.removeprefix(prefix): value for key, value in saved.items() if key.startswith(prefix)
    }
    loaded = base.state_dict()
    assert set(language) <= set(loaded)
    assert [key for key, value in language.items() if not torch.equal(loaded[key], value)] == []
    assert not any("tower" in name or "embed_vision" in name for name in loaded)


def test_the_plan_sizes_the_model_the_run_loads(multimodal_gemma4):
    """The planner reads the same text config: its count of the weights is the loaded language model's (red if
    it built the multimodal model, towers and all)."""
    recipe = recipe_on(multimodal_gemma4)
    shape = model_shape(recipe)
    assert shape.config.model_type == "gemma4_text"
    base = model.load_base_model(recipe.model, recipe.quant)
    assert shape.quantized_values + shape.unquantized_values == sum(p.numel() for p in base.parameters())


def test_a_checkpoint_without_some_language_model_weights_is_refused_in_one_line():
    with pytest.raises(RecipeError) as refused:
        text_only.check_loaded({"missing_keys": ["model.norm.weight"]}, "/ckpt", "gemma4_text")
    assert str(refused.value) == (
        "model.path: /ckpt holds no weights for 1 of gemma4_text's language model tensors (model.norm.weight)"
    )


@pytest.mark.slow  # trains two steps
def test_the_adapter_is_the_checkpoints_for_plain_peft_and_reads_back_onto_the_language_model(
    multimodal_gemma4, tmp_path
):
    """Written under the checkpoint's names with its targets as one expression: plain peft puts every tensor
    onto the multimodal model transformers builds, none onto a tower (red with peft's own names: no tensor
    lands; with its plain target names: peft tries the towers' ClippableLinear q_proj and raises), and
    qlora_kit's commands read the same values back onto the language model alone."""
    from peft import PeftModel, get_peft_model_state_dict

    from qlora_kit import train
    from qlora_kit.model import adapters
    from tests.conftest import quick_recipe

    run = train(
        quick_recipe(tmp_path / "run", **{"model.path": str(multimodal_gemma4), "train.max_steps": 2})
    ).output_dir
    saved = load_file(run / "adapter_model.safetensors")
    assert saved and all(".language_model." in key for key in saved)
    whole = transformers.AutoModelForCausalLM.from_pretrained(multimodal_gemma4, dtype=torch.float32)
    plain = get_peft_model_state_dict(PeftModel.from_pretrained(whole, str(run)))
    assert plain.keys() == saved.keys()
    assert all(torch.equal(plain[key], saved[key].to(plain[key].dtype)) for key in saved)
    recipe = recipe_on(multimodal_gemma4)
    ours = adapters.load_adapter(model.load_base_model(recipe.model, recipe.quant), run)
    named = {name: p for name, p in ours.named_parameters() if "lora_B" in name}
    trained = {k: v for k, v in saved.items() if "lora_B" in k and v.abs().sum() > 0}
    assert trained, "two steps move LoRA's B from zero"
    for key, value in trained.items():
        name = key.replace(".language_model.", ".").replace(".weight", ".default.weight")
        assert torch.equal(named[name].detach().to(value.dtype), value), name
