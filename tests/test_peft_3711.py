"""Shared experts and dense first layers trained, not silently skipped (model/peft_3711.py): peft 0.21.2 moves
every ``.gate_proj``/``.up_proj``/``.down_proj`` target of DeepSeek-V3, GLM-4.5 and Qwen3-Next onto the fused
experts (peft#3711); the wrap keeps them where they are for a model built by transformers 5, and the
canary below turns red as soon as the installed peft does so itself (then the wrap goes)."""

from __future__ import annotations

import pytest
import torch
import transformers
import yaml
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file

from qlora_kit.model import builtin, peft_3711
from qlora_kit.model.layers import is_linear

from .conftest import run_cli

# builtin -> the linears of its dense MLPs and shared experts (the names the conversion moves)
SHARED_EXPERTS = ("tiny-deepseek-v3", "tiny-glm4-moe", "tiny-qwen3-next")
MOVED = (".gate_proj", ".up_proj", ".down_proj")


def sixteen_bit(name: str):
    folder = builtin.ensure_tiny_model(name)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def dense_and_shared_linears(model) -> set[str]:
    """Every linear of a dense MLP or shared expert: the conversion's names outside the fused experts."""
    return {name for name, m in model.named_modules() if is_linear(m) and name.endswith(MOVED)}


def adapted(peft_model) -> set[str]:
    return {
        name.removeprefix("base_model.model.")
        for name, m in peft_model.named_modules()
        if isinstance(m, LoraLayer)
    }


def test_the_installed_peft_still_moves_the_shared_experts_targets():
    """The canary: plain peft on a transformers-5 DeepSeek-V3 puts no LoRA on its shared experts' and dense
    layer's linears; red as soon as the installed peft keeps them (peft PR #3715 released): then delete
    model/peft_3711.py and its calls."""
    base = sixteen_bit("tiny-deepseek-v3")
    wanted = dense_and_shared_linears(base)
    config = LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"])
    plain = adapted(get_peft_model(base, config))
    assert not plain & wanted, "peft keeps these targets itself now: delete qlora_kit/model/peft_3711.py"


def test_the_wrap_keeps_the_targets_only_for_a_model_built_by_transformers_5():
    """Under the wrap every such linear has LoRA; a model whose config says transformers 4 wrote it is left to
    peft's conversion (its adapters are the ones the conversion is for). Red without the wrap's patch."""
    base = sixteen_bit("tiny-deepseek-v3")
    wanted = dense_and_shared_linears(base)
    config = LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"])
    with peft_3711.targets_kept(base):
        assert adapted(get_peft_model(base, config)) == wanted
    converted = sixteen_bit("tiny-deepseek-v3")
    converted.config.transformers_version = "4.57.1"
    assert peft_3711.moved_linears(converted) == ["down_proj", "gate_proj", "up_proj"]
    with peft_3711.targets_kept(converted):
        kept = adapted(
            get_peft_model(converted, LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"]))
        )
    assert not kept & wanted


@pytest.mark.slow  # trains a step of each builtin from the shell
@pytest.mark.parametrize("name", SHARED_EXPERTS)
def test_shared_experts_train_from_the_shell_and_plain_peft_reloads_them(name, tmp_path, monkeypatch, capsys):
    """`qlora-kit train` on the builtin (4-bit experts, LoRA on all linear layers and the experts): every dense
    MLP's and shared expert's linear has a trained LoRA pair in the adapter (counted: 3 a layer), and peft
    loads the adapter back onto the 16-bit model onto the same targets (under the wrap, as qlora_kit's own
    loading does). Red without the wrap: the adapter holds none of them."""
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    values = {
        "model": {"path": f"builtin:{name}"},
        "quant": {"compute_dtype": "float32"},
        "optimizer": {"warmup_ratio": 0.0},  # the first step moves B off zero
        "data": {"path": "builtin:demo-facts", "max_seq_len": 32, "packing": False},
        "train": {
            "output_dir": str(out),
            "max_steps": 2,
            "micro_batch_size": 2,
            "sample_prompts": 0,
            "eval_steps": None,
        },
    }
    recipe.write_text(yaml.safe_dump(values))
    code, err = run_cli(["train", str(recipe)], monkeypatch, capsys)
    assert code == 0, err
    base = sixteen_bit(name)
    wanted = dense_and_shared_linears(base)
    layers = base.config.num_hidden_layers
    assert len(wanted) == 3 * layers  # a dense MLP or a shared expert in every layer
    saved = load_file(out / "adapter_model.safetensors")
    trained = {
        k.removeprefix("base_model.model.").rsplit(".lora_B", 1)[0]
        for k, v in saved.items()
        if ".lora_B." in k and v.abs().sum() > 0
    }
    assert wanted <= trained, sorted(wanted - trained)
    with peft_3711.targets_kept(base):
        reloaded = PeftModel.from_pretrained(base, str(out))
    assert wanted <= adapted(reloaded)


@pytest.mark.slow  # builds, saves and reloads a tiny Laguna three times
def test_an_adapter_saved_on_transformers_5_reloads_whole_where_a_renaming_would_break_it(tmp_path):
    """Laguna's transformers-4 renaming (``mlp.shared_expert.``, a regex) also matches ``mlp.shared_experts``:
    plain peft reloads its shared experts' LoRA under names the model has not (peft warns of missing keys and
    keeps them at B = 0); under the wrap every tensor lands. The plain half is a canary too."""
    import sys
    import warnings
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from tiny_configs import build_model

    folder = build_model("laguna", tmp_path / "model")
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"])
    get_peft_model(base, config).save_pretrained(tmp_path / "adapter")
    shared = {
        k for k in load_file(tmp_path / "adapter" / "adapter_model.safetensors") if "shared_experts" in k
    }
    assert shared
    for wrapped in (False, True):
        fresh = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if wrapped:
                with peft_3711.targets_kept(fresh):
                    PeftModel.from_pretrained(fresh, str(tmp_path / "adapter"))
            else:
                PeftModel.from_pretrained(fresh, str(tmp_path / "adapter"))
        missing = [str(w.message) for w in caught if "missing adapter keys" in str(w.message)]
        assert bool(missing) != wrapped, (
            missing or "transformers' renaming no longer breaks it: drop its half"
        )
