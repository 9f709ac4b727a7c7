"""Checkpointing policy wiring, the optimizer the Trainer builds, and gradients through checkpointed layers."""

import bitsandbytes as bnb
import pytest
import torch

from qlora_kit import Recipe
from qlora_kit.data import prepare
from qlora_kit.memory import checkpointing, optimizers
from qlora_kit.model import adapters
from qlora_kit.model import loading as model
from qlora_kit.training.objective_trainer import build_trainer
from qlora_kit.training.resolved import ResolvedRun


def base_with(**memory_fields):
    recipe = Recipe.from_dict({"memory": memory_fields})
    base = model.load_base_model(recipe.model, recipe.quant)
    return recipe, base, checkpointing.enable_checkpointing(base, recipe.memory)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"checkpointing": "full"}, [0, 1, 2, 3]),
        ({"checkpointing": "every_n", "every_n": 2}, [0, 2]),
        ({"checkpointing": "every_n", "every_n": 3}, [0, 3]),
        ({"checkpointing": "none"}, []),
    ],
)
def test_policy_checkpoints_the_right_layers(fields, expected):
    _, base, layers = base_with(**fields)
    assert layers == expected
    flags = [layer.gradient_checkpointing for layer in base.model.layers]
    assert [i for i, on in enumerate(flags) if on] == expected
    if expected:
        func = base.model.layers[0]._gradient_checkpointing_func
        assert func.keywords == {"use_reentrant": False}


def test_offload_on_a_cpu_takes_the_same_path_not_a_crash():
    _, base, layers = base_with(checkpointing="every_n", every_n=2, offload_activations=True)
    assert layers == [0, 2]
    assert checkpointing.offloaded_layers(base) == [0, 2]  # only the checkpointed layers keep an input
    ids = torch.randint(5, 600, (1, 8))
    base.train()
    base(
        input_ids=ids, labels=ids
    ).loss.backward()  # torch's save_on_cpu raises on pinned memory without CUDA


def test_every_lora_tensor_gets_finite_nonzero_gradients_through_checkpointed_layers(tmp_path):
    recipe, base, _ = base_with(checkpointing="full")
    peft_model = adapters.attach_lora(base, recipe.lora)
    tokenizer = model.load_tokenizer(recipe.model)
    train_set = prepare.prepare_datasets(recipe.data, tokenizer, seed=0).train
    recipe = recipe.with_overrides({"train.max_steps": 1, "train.output_dir": str(tmp_path)})
    trainer = build_trainer(ResolvedRun.as_given(recipe, tmp_path), peft_model, tokenizer, train_set, None)
    batch = next(iter(trainer.get_train_dataloader()))

    def grads():
        peft_model.zero_grad()
        peft_model(**batch).loss.backward()
        return {n: p.grad for n, p in peft_model.named_parameters() if p.requires_grad}

    first = grads()
    # peft starts B at zero, so A gets no gradient on the very first backward; B must.
    assert all(g is not None and g.abs().sum() > 0 for n, g in first.items() if "lora_B" in n)
    trainer.create_optimizer()
    trainer.optimizer.step()
    second = grads()
    for name, grad in second.items():
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0, name


def test_trainer_builds_the_paged_8bit_optimizer_with_the_recipe_lr(tmp_path):
    recipe = Recipe.from_dict({"optimizer": {"lr": 3e-3}, "train": {"output_dir": str(tmp_path)}})
    base = model.load_base_model(recipe.model, recipe.quant)
    peft_model = adapters.attach_lora(base, recipe.lora)
    tokenizer = model.load_tokenizer(recipe.model)
    train_set = prepare.prepare_datasets(recipe.data, tokenizer, seed=0).train
    trainer = build_trainer(ResolvedRun.as_given(recipe, tmp_path), peft_model, tokenizer, train_set, None)
    optimizer = trainer.create_optimizer()
    assert type(optimizer) is bnb.optim.PagedAdamW8bit
    assert optimizer.args.optim_bits == 8 and optimizer.is_paged
    assert {group["lr"] for group in optimizer.param_groups} == {3e-3}
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in peft_model.parameters() if p.requires_grad}


@pytest.mark.parametrize(
    ("name", "cls"),
    [("paged_adamw_32bit", "PagedAdamW32bit"), ("adamw_8bit", "AdamW8bit"), ("adamw_torch", "AdamW")],
)
def test_optimizer_names_map_to_classes(name, cls):
    recipe = Recipe.from_dict({"optimizer": {"name": name}})
    optimizer_class, kwargs = optimizers.optimizer_class_and_kwargs(recipe.optimizer)
    assert optimizer_class.__name__ == cls
    assert kwargs["lr"] == recipe.optimizer.lr
