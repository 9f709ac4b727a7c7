"""What a hub id is, and the failures of a fetch that the local hub server cannot stage (a full disk)."""

import errno

import pytest

from qlora_kit import Recipe
from qlora_kit.errors import RecipeError
from qlora_kit.model import hub


@pytest.mark.parametrize(
    ("path", "is_hub"),
    [
        ("meta-llama/Meta-Llama-3-8B", True),
        ("gpt2", True),
        ("builtin:tiny-llama", False),
        ("./models/llama", False),
        ("~/models/llama", False),
        ("org/name/extra", False),
        ("rows.jsonl", True),  # shaped like an id; recipe.check_paths names a missing local file first
    ],
)
def test_hub_ids(path, is_hub):
    assert hub.is_hub_id(path) is is_hub


def test_an_existing_folder_is_never_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not hub.is_hub_id("org/model")


def test_a_full_disk_mid_download_is_one_line_with_the_fix():
    """transformers wraps the OSError(ENOSPC) that writing a blob raises; the line names the cache."""
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as disk:
            raise OSError("Can't load the model for 'org/x'") from disk
    except OSError as exc:
        line = hub.explain(exc, "model.path", "org/x", None, "model")
    assert line.startswith("model.path: the disk ran full while downloading org/x (No space left on device")
    assert str(hub.cache_dir()) in line and "set HF_HOME to a larger disk" in line


def test_errors_that_are_not_the_hubs_pass_through():
    assert hub.explain(ValueError("bad dtype"), "model.path", "org/x", None, "model") is None
    with pytest.raises(ValueError, match="bad dtype"), hub.hub_errors("model.path", "org/x", None):
        raise ValueError("bad dtype")


@pytest.mark.parametrize("path", ["rows.jsonl", "./data", "builtin:demo-facts"])
def test_config_name_is_only_for_hub_datasets(path):
    with pytest.raises(RecipeError, match=r"data\.config_name: only for a hub dataset"):
        Recipe.from_dict({"data": {"path": path, "config_name": "a"}})


def test_only_the_weight_files_transformers_loads_are_counted():
    mistral = [
        "consolidated.safetensors",
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
    ]
    assert hub.weight_files([*mistral, "config.json"]) == mistral[1:]
    llama3 = ["original/consolidated.00.pth", "model-00001-of-00004.safetensors", "tokenizer.json"]
    assert hub.weight_files(llama3) == ["model-00001-of-00004.safetensors"]
    assert hub.weight_files(["pytorch_model.bin", "config.json"]) == ["pytorch_model.bin"]


def test_a_cache_miss_without_network_is_not_called_a_bad_id():
    """huggingface_hub's LocalEntryNotFoundError is an EntryNotFoundError too."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError as refused:
            raise LocalEntryNotFoundError("cannot find the requested files in the local cache") from refused
    except LocalEntryNotFoundError as exc:
        line = hub.explain(exc, "model.path", "org/x", None, "model")
    assert line.startswith("model.path: cannot reach the hub at "), line


def test_the_suite_ignores_the_shells_hub_settings():
    """conftest drops HF_HUB_OFFLINE and its kin before huggingface_hub reads them (at import): a shell
    that sets them gives the suite the same results (red under HF_HUB_OFFLINE=1 without that)."""
    import os

    from huggingface_hub import constants

    assert constants.HF_HUB_OFFLINE is False
    assert not {"HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT"} & set(
        os.environ
    )
