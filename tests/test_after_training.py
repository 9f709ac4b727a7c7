"""After training: evaluate, generate, merge with the drift check, exact resume, guards, manifest."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, TrainerCallback

from qlora_kit import Recipe, train
from qlora_kit.after.evaluate import evaluate
from qlora_kit.after.generate import generate
from qlora_kit.after.merge import merge_adapter
from qlora_kit.data import demo
from qlora_kit.errors import MergeDriftError, OutputDirError, TrainingGuardError
from qlora_kit.memory import checkpointing
from qlora_kit.model import adapters, builtin
from qlora_kit.model import loading as model

from .conftest import DEMO, PRECISIONS, copy_run, quick_recipe

pytestmark = pytest.mark.slow  # trains: the full suite runs it, the inner loop skips it


def folder_digest(folder):
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_eval_before_and_after_training(demo_run, tmp_path):
    out, _ = demo_run
    after = evaluate(adapter_dir=out, output=tmp_path / "after.json")
    before = evaluate(Recipe.from_yaml(DEMO))
    assert after["exact_match"] >= 0.9 and before["exact_match"] <= 0.1
    assert after["loss"] < 0.05 * before["loss"]
    assert after["perplexity"] == pytest.approx(torch.tensor(after["loss"]).exp().item())
    assert after["exact_match_examples"] == 56
    assert json.loads((tmp_path / "after.json").read_text()) == after


def test_generate_gives_the_trained_answers(demo_run):
    out, _ = demo_run
    answers = generate(str(out), ["What sound does a cow make?", "What is the capital of Japan?"])
    assert answers == ["moo", "Tokyo"]


def test_merged_model_loads_with_plain_transformers_and_matches_the_adapter(demo_run, tmp_path):
    out, _ = demo_run
    before = folder_digest(out)
    result = merge_adapter(out, tmp_path / "merged")
    assert folder_digest(out) == before, "merging never touches the adapter folder"
    assert result.drift.mean_kl < 1e-3 and result.drift.top1_agreement == 1.0
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
        assert (tmp_path / "merged" / name).is_file(), name
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not any("lora" in n for n, _ in merged.named_parameters())
    _, _, trained = adapters.load_trained(out)
    ids = torch.randint(5, 600, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trained.eval()(input_ids=ids).logits.float()
        got = merged.eval()(input_ids=ids).logits.float()
    assert (expected.argmax(-1) == got.argmax(-1)).float().mean() > 0.95
    assert (expected - got).abs().max() < 0.1 * expected.abs().max()


def test_drift_check_refuses_a_corrupted_adapter(demo_run, tmp_path):
    out, _ = demo_run
    broken = tmp_path / "broken"
    shutil.copytree(out, broken, ignore=shutil.ignore_patterns("checkpoint-*", "tensorboard"))
    tensors = load_file(broken / "adapter_model.safetensors")
    name = next(k for k in tensors if "lora_B" in k)
    tensors[name][0, :4] = float("nan")  # a few flipped bits' worth of damage
    save_file(tensors, broken / "adapter_model.safetensors")
    with pytest.raises(MergeDriftError, match="left in"):
        merge_adapter(broken, tmp_path / "merged")
    assert not (tmp_path / "merged").exists()
    assert len(list(tmp_path.glob(".merged.merging-*"))) == 1, "the refused export is kept aside"


def test_merge_refuses_a_folder_that_holds_files(demo_run, tmp_path):
    out, _ = demo_run
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    with pytest.raises(OutputDirError, match="already holds files"):
        merge_adapter(out, tmp_path / "taken")


class StopAt(TrainerCallback):
    """Stops a run after ``step`` optimizer steps, as an interruption would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def interrupted_then_resumed(recipe, step: int):
    """Train until ``step``, lose that step's checkpoint and the finished marker (as if killed while
    writing them), then resume from the newest complete checkpoint: the resumed run's result."""
    out = Path(recipe.train.output_dir)
    train(recipe, callbacks=[StopAt(step)])
    shutil.rmtree(out / f"checkpoint-{step}", ignore_errors=True)
    (out / "adapter_config.json").unlink()
    return train(recipe, resume=True)


def killed_after(recipe, step: int):
    """The finished run of ``recipe`` cut back to what a kill just after step ``step``'s checkpoint leaves
    (every later checkpoint and the finished marker lost; the later files beside them stay, as a kill
    while writing them leaves them), then resumed from the newest complete checkpoint: the resumed run's
    result. Its first ``step`` steps are the finished run's own (a run stopped there would have trained
    and saved the same ones), so the uninterrupted reference and the run that is resumed are one training."""
    out = Path(recipe.train.output_dir)
    for checkpoint in out.glob("checkpoint-*"):
        if int(checkpoint.name.split("-")[-1]) > step:
            shutil.rmtree(checkpoint)
    (out / "adapter_config.json").unlink()
    return train(recipe, resume=True)


@pytest.mark.parametrize(
    ("precision", "model", "grouped"),
    [
        *((p, "builtin:tiny-llama", False) for p in PRECISIONS),
        ("no", "builtin:tiny-llama", True),
        ("no", "builtin:tiny-qwen2-moe", False),  # routed experts and a shared expert (Qwen3-MoE's loop too)
        ("bf16", "builtin:tiny-gemma3", False),
    ],
    ids=[*PRECISIONS, "grouped", "moe", "vision"],
)
def test_resumed_run_ends_with_the_same_adapter_bit_for_bit(tmp_path, precision, model, grouped):
    """group_by_length's order too (drawn from the seed, not the random state a resume reaches another
    way), a mixture of experts (its 4-bit experts' LoRA takes no dropout, peft's rule), and a
    vision-language model under bf16 autocast on image rows (their pixels and Gemma-3's token types made
    again by the collator after the resume)."""
    dropout = 0.1 if model == "builtin:tiny-llama" else 0.0
    settings = {"train.max_steps": 8, "train.save_steps": 3, "lora.dropout": dropout, "data.packing": False}
    resumed_from = 3
    if grouped:  # 3 steps an epoch, resumed from step 4: inside the second epoch, whose order it draws again
        settings.update({"data.group_by_length": True, "train.micro_batch_size": 64, "train.save_steps": 4})
        resumed_from = 4
    settings.update({"train.mixed_precision": precision, "model.path": model})
    if "gemma3" in model:
        settings.update({"data.path": "builtin:shapes", "data.format": "chat"})
        settings.update({"data.max_seq_len": 96, "train.micro_batch_size": 2})
    recipe = quick_recipe(tmp_path / "run", **settings)
    whole = train(recipe)
    a = {k: t.clone() for k, t in load_file(whole.output_dir / "adapter_model.safetensors").items()}
    resumed = killed_after(recipe, resumed_from)
    b = load_file(resumed.output_dir / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    # written again by the resumed run (the kill took the finished run's)
    state = json.loads((tmp_path / "run" / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == 8


def test_resume_before_any_checkpoint_starts_again_and_a_finished_run_refuses(tmp_path, finished_run):
    started = train(quick_recipe(tmp_path / "empty", **{"train.max_steps": 2}), resume=True)
    assert json.loads((started.output_dir / "manifest.json").read_text())["steps"] == 2
    with pytest.raises(OutputDirError, match="holds a finished run"):
        train(quick_recipe(copy_run(finished_run, tmp_path), **{"train.max_steps": 2}), resume=True)


def test_gradient_guard_names_the_layers_checkpointing_cut_off(tmp_path):
    from qlora_kit.data import prepare
    from qlora_kit.training.objective_trainer import build_trainer
    from qlora_kit.training.resolved import ResolvedRun

    recipe = quick_recipe(tmp_path, **{"train.max_steps": 3, "memory.checkpointing": "none"})
    base = model.load_base_model(recipe.model, recipe.quant)
    # The classic mistake: reentrant checkpointing with inputs that do not require grad.
    base.activation_checkpointing_enable({"use_reentrant": True}, every_n_layers=2)
    base.disable_input_require_grads()
    peft_model = adapters.attach_lora(base, recipe.lora)
    tokenizer = model.load_tokenizer(recipe.model)
    prepared = prepare.prepare_datasets(recipe.data, tokenizer, seed=0)
    trainer = build_trainer(
        ResolvedRun.as_given(recipe, tmp_path), peft_model, tokenizer, prepared.train, None
    )
    with pytest.raises(
        TrainingGuardError, match=r"step 1: 7 LoRA tensors got no gradient .* in model\.layers\.0\."
    ):
        trainer.train()


def test_learning_rate_blow_up_stops_before_corrupting_the_checkpoint(tmp_path):
    # 8-bit AdamW bounds each update by the learning rate; torch's AdamW at 1e20 sends the weights past
    # bf16's range after the warmup step, so the next forward pass overflows.
    settings = {"optimizer.name": "adamw_torch", "optimizer.lr": 1e20, "train.max_steps": 20}
    recipe = quick_recipe(tmp_path / "out", **settings, **{"train.save_steps": 2})
    with pytest.raises(
        TrainingGuardError, match=r"step 3: the loss is NaN or infinite; .*checkpoint-2, is intact"
    ):
        train(recipe)
    weights = load_file(tmp_path / "out" / "checkpoint-2" / "adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())


class PoisonAfter(TrainerCallback):
    """Writes NaN into one LoRA matrix after ``step``: the next forward pass has a NaN loss."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.step:
            with torch.no_grad():
                next(p for n, p in model.named_parameters() if "lora_B" in n).fill_(float("nan"))


def test_nonfinite_loss_stops_at_that_step(tmp_path):
    recipe = quick_recipe(tmp_path / "out", **{"train.max_steps": 10, "train.save_steps": 2})
    with pytest.raises(
        TrainingGuardError, match=r"step 4: the loss is NaN or infinite; .*checkpoint-2, is intact"
    ):
        train(recipe, callbacks=[PoisonAfter(3)])
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists(), "no final output from a failed run"


def test_manifest_records_recipe_versions_data_hashes_and_machine(trained_run):
    manifest = json.loads((trained_run.output_dir / "manifest.json").read_text())
    assert manifest["recipe"]["train"]["max_steps"] == 30
    assert manifest["seed"] == 42 and manifest["steps"] == 30
    for library in ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "datasets"):
        assert manifest["versions"][library], library
    for path in demo.demo_data_files("demo-facts"):
        assert manifest["data_files"][str(path)] == hashlib.sha256(path.read_bytes()).hexdigest()
    config = builtin.ensure_tiny_model("tiny-llama") / "config.json"
    assert manifest["base_model"]["config_sha256"] == hashlib.sha256(config.read_bytes()).hexdigest()
    assert manifest["machine"]["cpu"] and manifest["finished_at"]
    commit = manifest["git_commit"]
    assert commit is None or len(commit.split("+")[0]) == 40


def test_checkpointing_policy_does_not_change_the_gradients():
    """Recompute must give the same LoRA gradients as keeping activations (fp32 compute, no dropout)."""
    grads = {}
    for policy in ("none", "full"):
        recipe = Recipe.from_dict(
            {"memory": {"checkpointing": policy}, "quant": {"compute_dtype": "float32"}}
        )
        base = model.load_base_model(recipe.model, recipe.quant)
        checkpointing.enable_checkpointing(base, recipe.memory)
        torch.manual_seed(0)  # the same A init for both policies
        peft_model = adapters.attach_lora(
            base, recipe.lora.model_copy(update={"dropout": 0.0, "init": "gaussian"})
        )
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0, 0.02, generator=torch.Generator().manual_seed(0))
        ids = torch.randint(5, 600, (2, 16), generator=torch.Generator().manual_seed(1))
        peft_model.train()
        peft_model(input_ids=ids, labels=ids).loss.backward()
        grads[policy] = {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    for name, grad in grads["none"].items():
        assert torch.allclose(grad, grads["full"][name], atol=1e-6), name


def test_eval_generate_and_merge_an_adapter_trained_in_either_precision(trained_run, tmp_path):
    """What comes after training reads an adapter from either code path; every input goes to its model's
    device (one device here, so this also guards the calls themselves)."""
    from qlora_kit.after.evaluate import evaluate
    from qlora_kit.after.generate import Sampling, complete, generate, wrap_prompt
    from qlora_kit.after.merge import merge_adapter

    adapter = trained_run.output_dir
    trained = evaluate(adapter_dir=adapter, max_examples=16)
    base = evaluate(Recipe.from_yaml(adapter / "recipe.yaml"), None, max_examples=16)
    assert trained["loss"] < base["loss"]
    question = "What sound does a cow make?"
    answers = generate(str(adapter), [question], Sampling(max_new_tokens=4))
    # greedy: the adapter read from disk answers as the trained model in memory does
    recipe = Recipe.from_yaml(adapter / "recipe.yaml")
    prompt = wrap_prompt(question, recipe.data, trained_run.tokenizer)
    expected = complete(trained_run.model, trained_run.tokenizer, prompt, Sampling(max_new_tokens=4))
    assert answers == [expected], (answers, expected)
    # at merge's own bounds: 30 steps leave near-flat distributions whose top-1 ties flip on rounding,
    # which the check leaves out (it counts top-1 where the adapter is decided)
    result = merge_adapter(adapter, tmp_path / "merged")
    assert result.drift.mean_kl < 1e-3, result.drift
