"""FSDP launch settings checked before any work; the FSDP checkpoint layout; guard names under wrappers.

The FSDP run itself (2 CPU processes, kill and resume) is tests/e2e/test_fsdp.py.
"""

import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

from qlora_kit import Recipe, RecipeError
from qlora_kit.cli import app as cli
from qlora_kit.training.distributed import check_fsdp_launch, fsdp_settings_of
from qlora_kit.training.pipeline import check_runnable
from qlora_kit.training.run_folder.outputs import is_complete_checkpoint
from qlora_kit.training.step.guards import TrainingGuard
from tests.conftest import lora_model

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "recipes" / "accelerate" / "fsdp-qlora.yaml"
FSDP_RECIPE = ROOT / "recipes" / "llama3-8b-alpaca-fsdp-2x24gb.yaml"


def config_with(tmp_path: Path, **fsdp_config) -> Path:
    config = yaml.safe_load(SHIPPED.read_text())
    config["fsdp_config"].update(fsdp_config)
    path = tmp_path / "accelerate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_shipped_fsdp_config_passes_with_the_shipped_fsdp_recipe():
    check_fsdp_launch(Recipe.from_yaml(FSDP_RECIPE), fsdp_settings_of(SHIPPED))


@pytest.mark.parametrize(
    ("setting", "field"),
    [
        ({"fsdp_version": 1}, "fsdp_version"),
        ({"fsdp_state_dict_type": "FULL_STATE_DICT"}, "fsdp_state_dict_type"),
        ({"fsdp_activation_checkpointing": True}, "fsdp_activation_checkpointing"),
    ],
)
def test_fsdp_settings_that_cannot_train_are_refused_naming_the_setting(setting, field, tmp_path):
    with pytest.raises(RecipeError, match=rf"^{field}: "):
        check_fsdp_launch(Recipe.from_yaml(FSDP_RECIPE), fsdp_settings_of(config_with(tmp_path, **setting)))


def test_a_config_without_a_version_is_fsdp1_and_refused(tmp_path):
    path = config_with(tmp_path)
    config = yaml.safe_load(path.read_text())
    del config["fsdp_config"]["fsdp_version"]
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(RecipeError, match=r"^fsdp_version: qlora_kit trains with FSDP2"):
        check_fsdp_launch(Recipe.from_yaml(FSDP_RECIPE), fsdp_settings_of(path))


def test_validate_checks_a_recipe_against_an_accelerate_config(tmp_path, monkeypatch, capsys):
    def validate(*args):
        monkeypatch.setattr(sys, "argv", ["qlora-kit", "validate", *args])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
        return exit_info.value.code, capsys.readouterr().err

    code, err = validate(str(FSDP_RECIPE), "--accelerate-config", str(SHIPPED))
    assert code == 0, err
    bad = config_with(tmp_path, fsdp_activation_checkpointing=True)
    code, err = validate(str(FSDP_RECIPE), "--accelerate-config", str(bad))
    assert code == 2 and err.strip().startswith("error: fsdp_activation_checkpointing: set it to false")
    assert len(err.strip().splitlines()) == 1
    code, err = validate(str(ROOT / "recipes" / "demo.yaml"), "--accelerate-config", str(SHIPPED))
    assert code == 2 and "train.fsdp: this run is launched with an FSDP config" in err


def test_the_command_leaves_its_process_group_before_the_interpreter_exits(tmp_path, monkeypatch, capsys):
    """A rank that exits still in its gloo process group can die of SIGABRT after saving, and torchrun
    then calls the run failed (CI, stop 85: GRPO under DDP). The command itself must leave the group,
    on an error as on success; a one-process gloo group stands in for a launched run's."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    for argv in (["recipes"], ["validate", str(tmp_path / "missing.yaml")]):
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        monkeypatch.setattr(sys, "argv", ["qlora-kit", *argv])
        with pytest.raises(SystemExit) as exit_info:
            cli.main()
        assert exit_info.value.code == (0 if argv == ["recipes"] else 2), capsys.readouterr().err
        assert not dist.is_initialized(), f"qlora-kit {argv[0]} exited still in its process group"


def test_a_recipe_with_fsdp_is_refused_without_an_fsdp_launch(tmp_path, monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    recipe = Recipe.from_yaml(FSDP_RECIPE, overrides={"train.output_dir": str(tmp_path / "out")})
    with pytest.raises(RecipeError, match=r"^train\.fsdp: the recipe shards the model with FSDP; launch it"):
        check_runnable(recipe)


def test_an_fsdp_checkpoint_is_complete_only_with_every_shard_folder_finished(tmp_path):
    folder = tmp_path / "checkpoint-3"
    for name in ("adapter_model.safetensors", "scheduler.pt", "pytorch_model_fsdp_0/.metadata"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"x")
    (folder / "trainer_state.json").write_text('{"global_step": 3}')
    (folder / "optimizer_0").mkdir()
    (folder / "optimizer_0" / "__0_0.distcp").write_bytes(b"x")
    assert not is_complete_checkpoint(folder), "the optimizer shards' .metadata is written last"
    (folder / "optimizer_0" / ".metadata").write_bytes(b"x")
    assert is_complete_checkpoint(folder)


def test_the_guard_finds_lora_parameters_again_after_a_wrapper_renames_them():
    model = lora_model()
    guard = TrainingGuard(model)
    names = set(guard.lora)
    layers = type(model.get_base_model().model.layers[0])
    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, layers))
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    guard.on_train_begin(None, None, None, model=model)
    assert set(guard.lora) == names
    wrapped = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}
    assert all(guard.lora[n] is wrapped[n] for n in names)


def test_cpu_ram_efficient_loading_is_said_to_save_nothing_with_4_bit(tmp_path, caplog):
    settings = fsdp_settings_of(config_with(tmp_path, fsdp_cpu_ram_efficient_loading=True))
    with caplog.at_level("WARNING", logger="qlora_kit.training.distributed"):
        check_fsdp_launch(Recipe.from_yaml(FSDP_RECIPE), settings)
    assert "fsdp_cpu_ram_efficient_loading saves nothing with a 4-bit model" in caplog.text
    caplog.clear()
    check_fsdp_launch(Recipe.from_yaml(FSDP_RECIPE), fsdp_settings_of(SHIPPED))
    assert "cpu_ram_efficient_loading" not in caplog.text
