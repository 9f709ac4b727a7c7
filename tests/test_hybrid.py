"""Layer types beyond full attention. Hybrid linear attention (Qwen3.5 and its mixture): why packing is
refused for them, that it is, and that their Gated DeltaNet projections load in 4 bits and take LoRA
(model/recurrent.py, registries/families.py); Qwen3-Next, whose shared experts peft's conversion would
leave without LoRA, is refused at load. Sliding windows (OLMo-3) and layers without RoPE (SmolLM3): packed
rows keep their examples apart, so they pack, and Gemma 4's too (its layers of two head sizes and shared keys
and values); a config that sets layer by layer a size qlora_kit reads once is refused in one line
(tests/test_families_matrix.py: dots3_note_text)."""

import logging

import pytest
import torch
import transformers

from qlora_kit import Recipe
from qlora_kit.data import layout, prepare
from qlora_kit.model import adapters, recurrent
from qlora_kit.model import loading as model
from qlora_kit.model.builtin import TINY_SHAPE
from qlora_kit.registries import families

from .conftest import DEMO, run_cli

HYBRIDS = ("tiny-qwen3.5", "tiny-qwen3.5-moe")


def fp32_model(name: str, **config_changes):
    entry = families.by_tiny_name(name)
    config = getattr(transformers, entry.config_class)(**TINY_SHAPE, **entry.tiny_config, **config_changes)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def second_examples_logits(peft_or_model, first: torch.Tensor, second: torch.Tensor):
    """The second example's logits alone, and packed behind the first as qlora_kit packs rows (positions
    restarting, no attention mask: transformers builds the block-diagonal mask from the restarts)."""
    with torch.no_grad():
        alone = peft_or_model(input_ids=second[None], use_cache=False).logits[0]
        positions = torch.cat([torch.arange(len(first)), torch.arange(len(second))])[None]
        packed_ids = torch.cat([first, second])[None]
        packed = peft_or_model(input_ids=packed_ids, position_ids=positions, use_cache=False).logits[0]
    return alone, packed[len(first) :]


# the mixture's case (1.5 s, as the dense one) runs in the full suite
@pytest.mark.parametrize("name", [HYBRIDS[0], pytest.param(HYBRIDS[1], marks=pytest.mark.slow)])
def test_a_packed_example_reads_the_state_its_neighbour_left_in_the_linear_attention_layers(name):
    """The reason packing is refused: with three Gated DeltaNet layers to one attention layer, the second
    example's logits move when it is packed behind the first; with attention layers only (the same model,
    layer_types all full_attention) they are the same but for the order of fp32 sums. Red if transformers
    ever keeps packed examples apart on this path: then packing could be allowed."""
    generator = torch.Generator().manual_seed(1)
    first, second = (
        torch.randint(5, 500, (20,), generator=generator),
        torch.randint(5, 500, (16,), generator=generator),
    )
    hybrid = fp32_model(name)
    assert recurrent.recurrent_layer_types(hybrid.config) == ("linear_attention",)
    attention_only = fp32_model(name, layer_types=["full_attention"] * TINY_SHAPE["num_hidden_layers"])
    assert recurrent.recurrent_layer_types(attention_only.config) == ()
    # four layers of fp32 sums taken in another order: a few units in the last place of the largest logit
    alone, packed = second_examples_logits(attention_only, first, second)
    bound = 64 * torch.finfo(torch.float32).eps * float(alone.abs().max())
    assert float((alone - packed).abs().max()) <= bound
    alone, packed = second_examples_logits(hybrid, first, second)
    assert float((alone - packed).abs().max()) > 1000 * bound


@pytest.mark.parametrize("name", ("tiny-olmo3", "tiny-smollm3", "tiny-gemma4"))
def test_sliding_windows_and_layers_without_rope_keep_packed_examples_apart(name):
    """Both examples longer than OLMo-3's and Gemma 4's builtin window (32): the second one's logits packed
    equal its logits alone but for the order of fp32 sums, and packing them is not refused (red if
    transformers' packed mask lost the window, or a sliding layer type were taken for a recurrent one).
    Gemma 4's last two layers read keys and values an earlier layer made from the packed row."""
    generator = torch.Generator().manual_seed(1)
    first, second = (
        torch.randint(5, 500, (40,), generator=generator),
        torch.randint(5, 500, (36,), generator=generator),
    )
    windowed = fp32_model(name)
    assert recurrent.recurrent_layer_types(windowed.config) == ()
    alone, packed = second_examples_logits(windowed, first, second)
    assert float((alone - packed).abs().max()) <= 64 * torch.finfo(torch.float32).eps * float(
        alone.abs().max()
    )


@pytest.mark.parametrize("name", HYBRIDS)
def test_packing_a_hybrid_is_refused_in_one_line(name, tmp_path, monkeypatch, capsys):
    code, err = run_cli(
        [
            "train",
            str(DEMO),
            "--set",
            f"model.path=builtin:{name}",
            "--set",
            "data.packing=true",
            "--output-dir",
            str(tmp_path),
        ],
        monkeypatch,
        capsys,
    )
    assert code == 2
    assert err.strip().splitlines() == [
        "error: data.packing: "
        f"{families.by_tiny_name(name).model_type}'s linear_attention layers carry a recurrent state from one "
        "packed example into the next (only attention keeps packed examples apart); "
        "set data.packing to false or auto"
    ]


@pytest.mark.parametrize("name", HYBRIDS)
def test_auto_does_not_pack_a_hybrid_and_says_why(name, caplog):
    recipe = Recipe.from_yaml(DEMO, overrides={"model.path": f"builtin:{name}"})
    assert recipe.data.packing == "auto"
    prepared = prepare.prepare_datasets(recipe.data, model.load_tokenizer(recipe.model), recipe.train.seed)
    with caplog.at_level(logging.INFO, logger=layout.__name__):
        assert layout.allowed_layouts(recipe, prepared) == ("padding", "group_by_length")
    assert "data.packing auto: not packing: " in caplog.text
    # the demo's own model packs (the refusal is the hybrid's, not the data's)
    demo = Recipe.from_yaml(DEMO)
    assert "packing" in layout.allowed_layouts(demo, prepared)


@pytest.mark.parametrize("name", HYBRIDS)
def test_the_gated_deltanet_projections_load_in_4_bits_and_take_lora(name):
    """all-linear reaches the linear-attention layers' projections as well as the attention layer's, and each
    is a bitsandbytes 4-bit layer under its adapter (a projection left in 16 bits would cost a user's GPU
    its memory; one left without LoRA would not train)."""
    import bitsandbytes as bnb
    from peft.tuners.lora import LoraLayer

    recipe = Recipe.from_dict({"model": {"path": f"builtin:{name}"}})
    peft_model = adapters.attach_lora(model.load_base_model(recipe.model, recipe.quant), recipe.lora)
    adapted = {path: layer for path, layer in peft_model.named_modules() if isinstance(layer, LoraLayer)}
    for wanted in families.by_tiny_name(name).linears:
        reached = [path for path in adapted if path.endswith(f".{wanted}")]
        assert reached, f"{wanted}: no LoRA"
        for path in reached:
            base = adapted[path].base_layer
            assert isinstance(base, bnb.nn.Linear4bit), f"{path}: {type(base).__name__}"


def test_doctor_says_which_cuda_kernels_would_speed_the_linear_attention_layers():
    """One row, a pass either way, naming each optional kernel package and whether it is installed (as
    Python finds its module, not as transformers' probe says): the linear-attention ones beside the others."""
    import importlib.util

    from qlora_kit.cli import doctor

    row = doctor._cuda_kernels()
    assert row.ok and row.name == "CUDA kernels"
    modules = {"flash-attn": "flash_attn", "flash-linear-attention": "fla", "causal-conv1d": "causal_conv1d"}
    modules["liger-kernel"] = "liger_kernel"
    for package, module in modules.items():
        state = "installed" if importlib.util.find_spec(module) else "not installed"
        assert f"{package} {state} (" in row.detail
    assert "Gated DeltaNet" in row.detail
