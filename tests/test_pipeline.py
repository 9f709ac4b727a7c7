"""The whole pipeline on tiny models: files written, loss falls, the adapter reloads with plain peft."""

import json

import pytest
import torch
import yaml
from peft import PeftModel

from qlora_kit import Recipe, train
from qlora_kit.errors import OutputDirError
from qlora_kit.model import loading as model

from .conftest import copy_run, quick_recipe
from .probes import EXPECTED_AUTOCAST

pytestmark = pytest.mark.slow  # trains: the full suite runs it, the inner loop skips it


def test_run_writes_adapter_tokenizer_recipe_metrics_and_tensorboard(trained_run):
    out = trained_run.output_dir
    for name in (
        "adapter_model.safetensors",
        "adapter_config.json",
        "tokenizer.json",
        "recipe.yaml",
        "metrics.jsonl",
    ):
        assert (out / name).is_file(), name
    assert any((out / "tensorboard").glob("events.out.tfevents.*"))
    assert not list(out.glob("*.bin")), "adapters are written as safetensors only"
    resolved = Recipe.from_dict(yaml.safe_load((out / "recipe.yaml").read_text()))
    assert resolved.train.max_steps == 30
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [5, 10, 15, 20, 25, 30]
    assert all({"loss", "lr"} <= row.keys() for row in rows)
    assert rows == trained_run.metrics


def test_the_run_trained_under_its_mixed_precision(trained_run):
    """Both of the fixture's precisions are what every test using it claims to cover: bf16 must be
    accelerate's autocast around the training forward, no must be none."""
    precision = Recipe.from_yaml(trained_run.output_dir / "recipe.yaml").train.mixed_precision
    assert trained_run.autocast == EXPECTED_AUTOCAST[precision], trained_run.autocast


def test_short_run_lowers_the_loss(trained_run):
    losses = trained_run.train_losses
    assert losses[-1] < 0.7 * losses[0], losses


def test_saved_adapter_loads_with_plain_peft_and_gives_the_same_logits(trained_run):
    recipe = Recipe.from_dict(yaml.safe_load((trained_run.output_dir / "recipe.yaml").read_text()))
    base = model.load_base_model(recipe.model, recipe.quant)
    reloaded = PeftModel.from_pretrained(base, str(trained_run.output_dir))
    ids = torch.randint(5, 600, (2, 16), generator=torch.Generator().manual_seed(0))
    trained_run.model.eval()
    reloaded.eval()
    with torch.no_grad():
        expected = trained_run.model(input_ids=ids).logits
        got = reloaded(input_ids=ids).logits
        plain = base.get_base_model()(input_ids=ids).logits if hasattr(base, "get_base_model") else None
    assert torch.equal(expected, got)
    with reloaded.disable_adapter(), torch.no_grad():
        plain = reloaded(input_ids=ids).logits
    assert not torch.allclose(plain, got), "the adapter changes the output"


def test_a_finished_run_is_not_overwritten_without_asking(finished_run, tmp_path):
    out = copy_run(finished_run, tmp_path)
    before = (out / "adapter_model.safetensors").read_bytes()
    with pytest.raises(OutputDirError, match="already holds a finished run"):
        train(quick_recipe(out, **{"train.max_steps": 1}))
    assert (out / "adapter_model.safetensors").read_bytes() == before


@pytest.mark.parametrize("arch", ["tiny-qwen2", "tiny-mistral"])
def test_other_architectures_run_the_same_pipeline(arch, tmp_path):
    recipe = quick_recipe(
        tmp_path / "out", **{"model.path": f"builtin:{arch}", "train.max_steps": 12, "train.logging_steps": 4}
    )
    result = train(recipe)
    assert result.checkpointed_layers == [0, 1, 2, 3]
    assert (result.output_dir / "adapter_model.safetensors").is_file()
    assert result.train_losses[-1] < result.train_losses[0]
    assert type(result.model.get_base_model()).__name__.lower().startswith(arch.split("-")[1])


def test_bad_data_with_overwrite_keeps_the_earlier_run(finished_run, tmp_path):
    from qlora_kit.errors import DataError

    out = copy_run(finished_run, tmp_path / "copy")
    before = sorted(p.name for p in out.iterdir())
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"instruction": "q", "input": ""}\n')  # no "output"
    recipe = quick_recipe(out, **{"data.path": str(bad), "data.val_path": str(bad), "train.max_steps": 1})
    with pytest.raises(DataError, match="missing field 'output'"):
        train(recipe, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before


def test_a_guards_stop_names_the_newest_complete_checkpoint(tmp_path):
    """One meaning of "newest checkpoint": the one --resume would take (complete), not a half-written one."""
    import json

    from qlora_kit.training.run_folder.outputs import CHECKPOINT_FILES
    from qlora_kit.training.step.guards import kept

    for step, complete in ((2, True), (4, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        names = CHECKPOINT_FILES if complete else CHECKPOINT_FILES[:1]
        for name in names:
            (folder / name).write_text(json.dumps({}) if name.endswith(".json") else "x")
    assert kept(str(tmp_path)) == f"the last checkpoint, {tmp_path / 'checkpoint-2'}, is intact"
    assert kept(str(tmp_path / "empty")) == "no checkpoint was written"
