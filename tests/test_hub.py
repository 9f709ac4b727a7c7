"""What a hub id is, and the failures of a fetch that the local hub server cannot stage (a full disk)."""

import errno

import pytest

from qlora_kit import Recipe, hub
from qlora_kit.recipe import RecipeError


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
