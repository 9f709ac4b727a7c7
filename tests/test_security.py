"""Security defaults: remote code is off unless asked and said when on; recipe paths are resolved
against the recipe file and recorded, as resolved, in the manifest; outputs are safetensors."""

import json
import shutil

import pytest

from qlora_kit import Recipe, train
from qlora_kit.data import demo
from qlora_kit.model import loading as model


def test_trust_remote_code_is_off_by_default_and_announced_when_on(caplog):
    assert Recipe().model.trust_remote_code is False
    caplog.set_level("WARNING", logger="qlora_kit")
    recipe = Recipe.from_dict({"model": {"trust_remote_code": True}})
    model.load_base_model(recipe.model, recipe.quant)
    assert "model.trust_remote_code is on: code shipped with builtin:tiny-llama will run" in caplog.text


@pytest.mark.slow  # trains: the fast tier (-m 'not slow') trains nothing
def test_relative_paths_resolve_against_the_recipe_and_land_in_the_manifest(tmp_path):
    train_file, val_file = demo.demo_data_files("demo-facts")
    (tmp_path / "data").mkdir()
    shutil.copy(train_file, tmp_path / "data" / "train.jsonl")
    shutil.copy(val_file, tmp_path / "data" / "val.jsonl")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "r.yaml").write_text(
        "data:\n  path: ../data/train.jsonl\n  val_path: ../data/val.jsonl\ntrain:\n  max_steps: 2\n"
    )
    recipe = Recipe.from_yaml(
        tmp_path / "recipes" / "r.yaml", overrides={"train.output_dir": str(tmp_path / "out")}
    )
    result = train(recipe)
    manifest = json.loads((result.output_dir / "manifest.json").read_text())
    assert manifest["recipe"]["data"]["path"] == str(tmp_path / "data" / "train.jsonl")
    assert set(manifest["data_files"]) == {
        str(tmp_path / "data" / "train.jsonl"),
        str(tmp_path / "data" / "val.jsonl"),
    }
    written = {p.suffix for p in result.output_dir.iterdir() if p.is_file()}
    assert ".safetensors" in written and ".bin" not in written and ".pt" not in written
