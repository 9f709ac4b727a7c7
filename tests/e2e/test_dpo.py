"""train.objective dpo end to end: TRL's loss against the formula, the reference policy, one 4-bit base,
exact resume, evaluation, and the demo's bar from the README — in both of the Trainer's precisions."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from peft import PeftModel
from safetensors.torch import load_file

from qlora_kit import Recipe, RecipeError, evaluate, train
from qlora_kit.after.preference_eval import answer_logps, reference_logps
from qlora_kit.data import prepare
from qlora_kit.model import loading as model
from qlora_kit.training.pipeline import build, check_runnable

from ..conftest import gpu_compute_under_bf16, run_cli_output
from ..probes import EXPECTED_AUTOCAST, AutocastProbe
from ..test_after_training import interrupted_then_resumed

pytestmark = pytest.mark.slow  # end to end: the full suite runs it, the inner loop skips it

ROOT = Path(__file__).resolve().parents[2]
DEMO_DPO = ROOT / "recipes" / "demo-dpo.yaml"


def dpo_recipe(output_dir: Path, **overrides) -> Recipe:
    values = {"train.output_dir": str(output_dir), "train.sample_prompts": 0, "train.eval_steps": None}
    return Recipe.from_yaml(DEMO_DPO, overrides=gpu_compute_under_bf16({**values, **overrides}))


def four_bit_storage(module: torch.nn.Module) -> dict[int, int]:
    """data_ptr -> bytes of every packed 4-bit weight the module holds."""
    return {
        p.data_ptr(): p.numel() * p.element_size()
        for p in module.parameters()
        if type(p).__name__ == "Params4bit"
    }


def test_loss_equals_the_dpo_formula_on_the_reference_adapter(tmp_path):
    setup = build(dpo_recipe(tmp_path / "out", **{"train.micro_batch_size": 4, "preference.beta": 0.5}))
    peft_model, trainer = setup.model, setup.trainer
    torch.manual_seed(0)
    with torch.no_grad():  # move the policy away from the reference, which stays at the adapter's start
        for name, parameter in peft_model.named_parameters():
            if ".default." in name and "lora_B" in name:
                parameter.normal_(0, 0.05)
    pairs = setup.data.train.select(range(4))
    policy_chosen, policy_rejected, _ = answer_logps(peft_model, pairs)
    peft_model.set_adapter("ref")
    reference_chosen, reference_rejected, _ = answer_logps(peft_model, pairs)
    peft_model.set_adapter("default")
    with peft_model.disable_adapter():  # a fresh adapter's reference is the base itself
        base_chosen, _, _ = answer_logps(peft_model, pairs)
    assert torch.allclose(reference_chosen, base_chosen, atol=1e-5)
    delta = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    expected = -F.logsigmoid(0.5 * delta).mean()

    batch = trainer.data_collator([pairs[i] for i in range(4)])
    peft_model.train()
    loss = trainer.compute_loss(peft_model, batch)
    assert abs(loss.item() - expected.item()) < 1e-4, (loss.item(), expected.item())
    assert float(expected) != pytest.approx(math.log(2), abs=1e-3)  # the policy did move
    accuracy = trainer._metrics["train"]["rewards/accuracies"][-1]
    assert accuracy == pytest.approx(float((delta > 0).float().mean()))


def test_reference_is_the_starting_adapter_on_the_one_4bit_base(trained_run, tmp_path):
    sft = trained_run.output_dir  # one per precision of the Trainer (conftest.PRECISIONS): DPO runs the same
    precision = Recipe.from_yaml(sft / "recipe.yaml").train.mixed_precision
    recipe = dpo_recipe(
        tmp_path / "out",
        **{"model.adapter": str(sft), "train.max_steps": 3, "train.mixed_precision": precision},
    )
    setup = build(recipe)
    peft_model, trainer = setup.model, setup.trainer
    assert trainer.args.bf16 is (precision == "bf16") and trainer.accelerator.mixed_precision == precision
    probe = AutocastProbe()
    trainer.add_callback(probe)
    # the policy starts as the SFT adapter, in fp32, bit for bit; the reference is a copy of it
    start = load_file(sft / "adapter_model.safetensors")
    state = {name: p for name, p in peft_model.named_parameters() if ".default." in name}
    for key, value in start.items():
        policy = state[key.replace(".weight", ".default.weight")]
        assert policy.dtype == torch.float32 and torch.equal(policy.detach(), value), key
    # one 4-bit base: as many packed weights, of the same bytes, as a freshly loaded base holds
    fresh = model.load_base_model(recipe.model, recipe.quant)
    assert sorted(four_bit_storage(peft_model).values()) == sorted(four_bit_storage(fresh).values())
    assert trainer.ref_model is None
    # the reference log-probabilities are the SFT adapter's, loaded the plain peft way on another base
    pairs = setup.data.val.select(range(8))
    plain = PeftModel.from_pretrained(fresh, str(sft))
    expected = answer_logps(plain, pairs)
    peft_model.set_adapter("ref")
    before = answer_logps(peft_model, pairs)
    peft_model.set_adapter("default")
    assert torch.allclose(before[0], expected[0], atol=1e-5) and torch.allclose(
        before[1], expected[1], atol=1e-5
    )

    trainer.train()
    assert probe.seen == EXPECTED_AUTOCAST[precision], probe.seen  # DPO under the Trainer's autocast
    trainer.accelerator.unwrap_model(
        peft_model, keep_fp32_wrapper=False
    )  # bf16: autocast off again, as run() does
    reference = {name: p for name, p in peft_model.named_parameters() if ".ref." in name}
    for key, value in start.items():
        assert torch.equal(reference[key.replace(".weight", ".ref.weight")].detach(), value), key
    peft_model.set_adapter("ref")
    after = answer_logps(peft_model, pairs)
    peft_model.set_adapter("default")
    assert torch.equal(after[0], before[0]), "the reference moved"
    assert not torch.equal(answer_logps(peft_model, pairs)[0], before[0]), "the policy did not move"
    rows = trainer.metrics_log.rows
    assert any("rewards/margins" in row for row in rows)


def test_the_reference_for_evaluating_a_bare_base_leaves_the_base_bare(trained_run, tmp_path):
    """qlora-kit eval --no-adapter on a DPO recipe with model.adapter: the SFT reference is scored on the
    same base, which must answer as the base again afterwards (exact match is measured on it next)."""
    sft = trained_run.output_dir
    recipe = dpo_recipe(tmp_path / "out", **{"model.adapter": str(sft)})
    base = model.load_base_model(recipe.model, recipe.quant)
    pairs = prepare.prepare_datasets(recipe.data, model.load_tokenizer(recipe.model), 0).val.select(range(4))
    alone = answer_logps(base, pairs)
    reference = reference_logps(base, recipe, pairs)
    assert not torch.equal(reference[0], alone[0])  # the SFT adapter scored them
    again = answer_logps(base, pairs)
    assert torch.equal(again[0], alone[0]) and torch.equal(again[1], alone[1])
    assert not any("lora" in name for name, _ in base.named_modules())

    # a starting adapter that trains biases cannot have DPO's second adapter beside it: one line, before loading
    biased = tmp_path / "biased"
    shutil.copytree(sft, biased, ignore=shutil.ignore_patterns("checkpoint-*", "tensorboard"))
    config = json.loads((biased / "adapter_config.json").read_text())
    (biased / "adapter_config.json").write_text(json.dumps({**config, "bias": "all"}))
    with pytest.raises(RecipeError, match=f"model.adapter: {biased} trains biases"):
        check_runnable(dpo_recipe(tmp_path / "out", **{"model.adapter": str(biased)}))


def test_resumed_dpo_run_ends_with_the_same_adapter_bit_for_bit(tmp_path):
    settings = {"train.max_steps": 6, "train.save_steps": 2, "train.mixed_precision": "bf16"}
    whole = train(dpo_recipe(tmp_path / "whole", **settings))
    resumed = interrupted_then_resumed(dpo_recipe(tmp_path / "split", **settings), 3)  # from step 2
    a = load_file(whole.output_dir / "adapter_model.safetensors")
    b = load_file(resumed.output_dir / "adapter_model.safetensors")
    assert a.keys() == b.keys() and not any(".ref." in key for key in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    checkpoint = tmp_path / "split" / "checkpoint-6"
    assert not (checkpoint / "ref").exists()  # only the trained adapter is saved, never TRL's copy


def test_the_demo_reaches_its_bar_and_bad_pairs_are_one_line(tmp_path, monkeypatch, capsys):
    """The README's DPO demo, its command in this process (conftest.run_cli_output; the README's first
    command as a process of its own is conftest's demo_run): held-out preference accuracy from the base's
    to >= 0.9. The bad pairs' refusal too: it stops at the data, before any work."""

    out = tmp_path / "demo-dpo"
    code, _, err = run_cli_output(["train", str(DEMO_DPO), "--output-dir", str(out)], monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert "the reference policy is the base model" in " ".join(err.split())
    after = evaluate(adapter_dir=str(out))
    before = evaluate(Recipe.from_yaml(DEMO_DPO), adapter_dir=None)
    assert before["preference_accuracy"] == 0.0 and before["likelihood_accuracy"] < 0.7, before
    assert after["preference_accuracy"] >= 0.9 and after["likelihood_accuracy"] >= 0.9, after
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_rewards/accuracies" in row for row in rows)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"instruction": "Q?", "chosen": "yes", "rejected": "yes"}) + "\n")
    argv = ["train", str(DEMO_DPO), "--output-dir", str(tmp_path / "never"), "--set", f"data.path={bad}"]
    argv += ["--set", "train.eval_steps=null", "--set", "train.sample_prompts=0"]
    code, _, err = run_cli_output(argv, monkeypatch, capsys)
    assert code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert lines == [
        f"error: {bad}: row 1: chosen and rejected are the same answer; the pair teaches nothing"
    ]
    assert "Traceback" not in err and not (tmp_path / "never" / "manifest.json").exists()
