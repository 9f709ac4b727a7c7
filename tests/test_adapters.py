"""LoRA attachment: what trains, and how recipe fields reach peft."""

import bitsandbytes as bnb
import pytest

from qlora_kit import Recipe
from qlora_kit.model import adapters
from qlora_kit.model import loading as model


def attach(**lora):
    recipe = Recipe.from_dict({"lora": lora})
    base = model.load_base_model(recipe.model, recipe.quant)
    return adapters.attach_lora(base, recipe.lora)


def test_only_lora_matrices_require_grad():
    peft_model = attach(rank=8)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # all-linear: every 4-bit linear got an adapter, and the output head did not
    wrapped = [
        m for m in peft_model.modules() if isinstance(getattr(m, "base_layer", None), bnb.nn.Linear4bit)
    ]
    assert len(wrapped) == 28
    assert not hasattr(peft_model.base_model.model.lm_head, "lora_A")
    lora_a = peft_model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"]
    assert lora_a.weight.shape == (8, 128)


def test_target_list_and_options_reach_peft():
    peft_model = attach(rank=4, alpha=8, target_modules=["q_proj", "v_proj"], rslora=True, bias="lora_only")
    config = peft_model.peft_config["default"]
    assert set(config.target_modules) == {"q_proj", "v_proj"}
    assert config.use_rslora and config.bias == "lora_only"
    adapted = {n.split(".")[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"q_proj", "v_proj"}
    layer = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == 8 / 4**0.5  # rsLoRA: alpha / sqrt(r)


def test_dora_adds_a_magnitude_vector():
    peft_model = attach(rank=4, dora=True, target_modules=["q_proj"])
    names = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any("lora_magnitude_vector" in n for n in names)


def test_trainable_count_counts_4bit_values_not_bytes():
    peft_model = attach(rank=8)
    trainable, total = adapters.trainable_parameter_count(peft_model)
    base_values = sum(
        m.in_features * m.out_features for m in peft_model.modules() if isinstance(m, bnb.nn.Linear4bit)
    )
    lora_values = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    assert trainable == lora_values
    assert total > base_values + lora_values  # plus embeddings, norms and head


def adapter_of(arch: str, folder):
    """An adapter as qlora-kit train writes one (its adapter files and recipe.yaml), on ``arch``, untrained."""
    recipe = Recipe.from_dict({"model": {"path": f"builtin:{arch}"}, "lora": {"rank": 4}})
    base = model.load_base_model(recipe.model, recipe.quant)
    adapters.attach_lora(base, recipe.lora).save_pretrained(folder)
    (folder / "recipe.yaml").write_text(recipe.to_yaml(), encoding="utf-8")
    return folder


def continuing(adapter, tmp_path, **sets) -> Recipe:
    """The demo recipe continuing ``adapter``, its rows packed (what data.packing auto picks on the demo
    set, tests/test_layout.py's) and eager: a build times no layouts and compiles nothing (train.compile
    auto times eager steps and may compile the layers to time them too), which these tests do not read."""
    values = {"model.adapter": str(adapter), "train.output_dir": str(tmp_path / "out"), "data.packing": True}
    values["train.compile"] = False
    values |= sets
    return Recipe.from_yaml("recipes/demo.yaml", overrides=values)


@pytest.mark.slow  # builds two tiny models and a run: about 10 s on 2 busy cores
def test_an_adapter_of_another_architecture_is_one_line_naming_its_base(tmp_path):
    """A GPT-2 adapter (c_attn, c_fc: Conv1D layers a Llama has not) continued on the tiny Llama: peft's
    NoMatchingPeftModuleError traceback before; one line naming both, exit 2, now."""
    from qlora_kit.errors import RecipeError
    from qlora_kit.training.pipeline import build

    gpt2 = adapter_of("tiny-gpt2", tmp_path / "gpt2-adapter")
    with pytest.raises(RecipeError) as info:
        build(continuing(gpt2, tmp_path))
    line = str(info.value)
    assert line.startswith(f"model.adapter: {gpt2} was trained on builtin:tiny-gpt2, whose layers this base")
    assert "(llama)" in line and "\n" not in line


@pytest.mark.slow  # builds three tiny models and two runs: about 12 s on 2 busy cores
def test_an_adapter_of_another_base_of_the_same_shapes_loads_with_one_warning_naming_both(tmp_path, caplog):
    from qlora_kit.training.pipeline import build

    mistral = adapter_of("tiny-mistral", tmp_path / "mistral-adapter")
    with caplog.at_level("WARNING", logger="qlora_kit"):
        build(continuing(mistral, tmp_path))
    warned = [r.getMessage() for r in caplog.records if "trained on" in r.getMessage()]
    assert len(warned) == 1
    assert "trained on builtin:tiny-mistral, not on this run's base builtin:tiny-llama" in warned[0]
    caplog.clear()
    llama = adapter_of("tiny-llama", tmp_path / "llama-adapter")
    with caplog.at_level("WARNING", logger="qlora_kit"):
        build(continuing(llama, tmp_path))
    assert not [r for r in caplog.records if "trained on" in r.getMessage()], "its own base: no warning"


def test_an_adapter_whose_tensors_name_no_layer_of_the_base_is_one_line_not_the_base_model(
    finished_run, tmp_path
):
    """peft only warns when a LoRA layer it made finds no tensor in the file, and keeps B at zero: every
    command would run the base model as the adapter (as a Gemma 4 adapter under the checkpoint's names read
    without the key mapping did). Refused in one line (red without the check: it loads)."""
    from safetensors.torch import load_file, save_file

    from qlora_kit.errors import RecipeError
    from tests.conftest import copy_run

    run = copy_run(finished_run, tmp_path)
    weights = run / "adapter_model.safetensors"
    tensors = load_file(weights)
    save_file({k.replace(".layers.", ".blocks."): v for k, v in tensors.items()}, weights)
    recipe = Recipe.from_dict({})
    base = model.load_base_model(recipe.model, recipe.quant)
    with pytest.raises(RecipeError) as refused:
        adapters.load_adapter(base, run)
    line = str(refused.value)
    assert (
        line.startswith(f"--adapter: {run} holds no tensors for {len(tensors)} of the LoRA weights")
        and "\n" not in line
    )


@pytest.mark.parametrize(
    "arch, lora",
    [("tiny-qwen3-moe", {"experts": True}), ("tiny-llama", {"dora": True})],  # experts' stacks, DoRA
)
def test_the_planners_empty_lora_is_the_runs_without_drawing(arch, lora):
    """attach_lora(empty=True), the planner's trace's (fake_forward): on a meta model of the compute dtype,
    the same adapter tensors as the run's attach_lora (names, shapes, dtypes: peft moves the run's to the
    base's dtype and back to float32, the empty ones stay float32; trainability), nothing drawn from the
    CPU's generator (red with peft's default: each LoRA A drawn on the CPU, then moved to meta; red with the
    run's adapters left in the base's bfloat16, peft's cast off)."""
    import torch

    from qlora_kit.memory.shapes import model_shape
    from qlora_kit.model import vision

    recipe = Recipe.from_dict({"model": {"path": f"builtin:{arch}"}, "lora": lora})
    config = model_shape(recipe).config

    def meta_model():
        with torch.device("meta"):
            return vision.auto_class(config).from_config(config, dtype=torch.bfloat16)

    def facts(peft_model):
        return {n: (tuple(p.shape), p.dtype, p.requires_grad) for n, p in peft_model.named_parameters()}

    run = facts(adapters.attach_lora(meta_model(), recipe.lora))
    state = torch.random.get_rng_state()
    empty = facts(adapters.attach_lora(meta_model(), recipe.lora, empty=True))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert empty == run
    trained = {n: f[1] for n, f in run.items() if f[2]}
    assert trained and set(trained.values()) == {torch.float32}
    assert any("experts" in n for n in trained) == lora.get("experts", False)
