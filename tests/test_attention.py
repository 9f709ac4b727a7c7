"""The attention kernel a recipe names: validated, installed or refused in one line, and the one that runs."""

import importlib.util
import json
import shutil

import pytest
import torch

from qlora_kit import Recipe
from qlora_kit.data import prepare
from qlora_kit.data.packing import FlattenedRowsCollator, PackedRowCollator
from qlora_kit.errors import RecipeError
from qlora_kit.model import builtin
from qlora_kit.model import loading as model
from qlora_kit.registries import attention
from qlora_kit.training.pipeline import check_runnable


@pytest.mark.parametrize(
    ("values", "line"),
    [
        (
            {"model": {"attn_implementation": "flash"}},
            "model.attn_implementation: 'flash' is not one of auto, sdpa",
        ),
        (
            {"model": {"attn_implementation": "flash_attention_2"}, "quant": {"compute_dtype": "float32"}},
            "quant.compute_dtype: flash_attention_2 computes in bfloat16 or float16 only",
        ),
        (
            # packing asked for explicitly (auto, the default, never packs with such a kernel)
            {"model": {"attn_implementation": "someone/paged-attention"}, "data": {"packing": True}},
            "data.packing: cannot tell whether someone/paged-attention keeps packed examples apart",
        ),
    ],
)
def test_impossible_kernels_are_refused_by_validate(values, line):
    with pytest.raises(RecipeError) as caught:
        Recipe.from_dict(values)
    assert str(caught.value).startswith(line)


def test_an_unknown_hub_kernel_without_packing_is_accepted():
    recipe = Recipe.from_dict(
        {"model": {"attn_implementation": "someone/paged-attention"}, "data": {"packing": False}}
    )
    assert attention.kernel(recipe.model.attn_implementation).packing is None


@pytest.mark.parametrize(
    ("kernel", "line"),
    [
        ("flash_attention_2", "needs the flash-attn package (pip install flash-attn --no-build-isolation)"),
        ("flash_attention_3", "needs FlashAttention-3"),
        # transformers 5.25 requires the kernels package, so it is installed where transformers is new
        (
            "kernels-community/flash-attn",
            "trains on CUDA GPUs only; on this machine use sdpa or eager"
            if importlib.util.find_spec("kernels")
            else "needs the kernels package (pip install kernels)",
        ),
        pytest.param(
            "flex_attention",
            "trains on CUDA GPUs only; on this machine use sdpa or eager",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="runs on this machine's GPU"),
        ),
    ],
)
def test_a_kernel_this_machine_cannot_run_is_one_line_before_any_work(kernel, line, tmp_path):
    recipe = Recipe.from_dict(
        {"model": {"attn_implementation": kernel}, "train": {"output_dir": str(tmp_path / "out")}}
    )
    with pytest.raises(RecipeError, match=r"model\.attn_implementation: ") as caught:
        check_runnable(recipe)
    assert line in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_the_recipes_kernel_runs_even_when_config_json_names_another(tmp_path):
    """transformers lets a config.json "_attn_implementation" override from_pretrained's argument."""
    folder = tmp_path / "model"
    shutil.copytree(builtin.ensure_tiny_model("tiny-llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"_attn_implementation": "eager"}))
    for kernel, runs in (("sdpa", "sdpa"), ("eager", "eager"), ("auto", "sdpa")):
        recipe = Recipe.from_dict({"model": {"path": str(folder), "attn_implementation": kernel}})
        base = model.load_base_model(recipe.model, recipe.quant)
        assert base.config._attn_implementation == runs
        assert base.model.layers[0].self_attn.config._attn_implementation == runs


def test_auto_is_sdpa_where_the_architecture_has_it_and_an_explicit_kernel_it_lacks_is_one_line():
    gemma = Recipe.from_dict({"model": {"path": "builtin:tiny-gemma2"}})
    assert model.load_base_model(gemma.model, gemma.quant).config._attn_implementation == "eager"
    sdpa = gemma.with_overrides({"model.attn_implementation": "sdpa"})
    with pytest.raises(RecipeError) as caught:
        model.load_base_model(sdpa.model, sdpa.quant)
    assert str(caught.value) == (
        "model.attn_implementation: Gemma2ForCausalLM does not support sdpa in this transformers; use auto or eager"
    )


@pytest.mark.parametrize(
    ("kernel", "collator"),
    [
        ("sdpa", PackedRowCollator),
        ("eager", PackedRowCollator),
        ("flex_attention", PackedRowCollator),
        ("flash_attention_2", FlattenedRowsCollator),
        ("flash_attention_3", FlattenedRowsCollator),
        ("kernels-community/flash-attn3", FlattenedRowsCollator),
    ],
)
def test_packed_rows_reach_each_kernel_without_cross_attention(kernel, collator):
    """Rows with restarting positions where transformers builds a block mask at any batch size; one
    flattened sequence with varlen boundaries for flash kernels, whose packed-sequence detection works
    only at batch size 1."""
    tokenizer = builtin.build_tokenizer()
    assert isinstance(prepare.build_collator(tokenizer, True, kernel), collator)
    rows = [
        {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7, -100, 9], "position_ids": [0, 1, 2, 0, 1]},
        {"input_ids": [10, 11, 12], "labels": [-100, 11, 12], "position_ids": [0, 1, 2]},
    ]
    batch = prepare.build_collator(tokenizer, True, kernel)(rows)
    if collator is FlattenedRowsCollator:
        assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
        assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 3, 5, 8]
        assert batch["cu_seq_lens_q"].dtype == torch.int32
        assert batch["max_length_q"] == batch["max_length_k"] == 3
        assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, 11, 12]]
    else:
        assert batch["input_ids"].shape == (2, 5) and "cu_seq_lens_q" not in batch


@pytest.mark.slow
def test_eager_trains_packed_under_bf16_autocast_and_reloads_with_its_kernel(tmp_path):
    """The GPU's path (the Trainer's bf16 autocast) with another kernel than the default, packing on."""
    from qlora_kit import train
    from qlora_kit.model import adapters
    from tests.conftest import quick_recipe

    settings = {
        "model.attn_implementation": "eager",
        "train.max_steps": 4,
        "train.logging_steps": 1,
        "train.mixed_precision": "bf16",
    }
    result = train(quick_recipe(tmp_path / "out", **settings))
    assert result.model.get_base_model().config._attn_implementation == "eager"
    assert len(result.train_losses) == 4 and all(torch.isfinite(torch.tensor(result.train_losses)))
    _, _, reloaded = adapters.load_trained(tmp_path / "out")
    assert reloaded.get_base_model().config._attn_implementation == "eager"
