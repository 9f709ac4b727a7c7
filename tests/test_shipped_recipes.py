"""The recipes shipped inside the package: the repository's recipes/ itself, found by name, listed with
the planner's memory, shown, copied out without overwriting, and the same wherever a copy lives."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import psutil
import pytest
import torch

from qlora_kit.recipe import shipped
from qlora_kit.recipe.recipe import Recipe

from .conftest import run_cli_output as run_cli

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def test_the_package_ships_the_repository_recipes_folder_itself():
    # one folder, no second copy: in a checkout the package's recipes are the top-level files
    assert shipped.folder().resolve() == (ROOT / "recipes").resolve()
    assert shipped.recipe_names() == sorted(path.stem for path in RECIPES)
    assert shipped.accelerate_names() == ["accelerate/fsdp-qlora"]


def test_a_path_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert shipped.resolve(Path("demo")) == shipped.folder() / "demo.yaml"
    assert shipped.resolve(Path("demo.yaml")) == shipped.folder() / "demo.yaml"
    # the form the README and the recipes' own comments use, from a folder that has no recipes/
    assert shipped.resolve(Path("recipes/demo.yaml")) == shipped.folder() / "demo.yaml"
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "demo.yaml").write_text("train:\n  epochs: 2\n")
    (tmp_path / "demo").write_text("train:\n  epochs: 3\n")
    assert shipped.resolve(Path("recipes/demo.yaml")) == Path("recipes/demo.yaml")
    assert shipped.resolve(Path("demo")) == Path("demo")
    # an accelerate config is not a recipe, and an unknown name stays the path (its read error names it)
    assert shipped.resolve(Path("accelerate/fsdp-qlora")) == Path("accelerate/fsdp-qlora")
    assert shipped.resolve(Path("nosuch")) == Path("nosuch")


@pytest.mark.parametrize("name", [path.stem for path in RECIPES])
def test_a_copied_recipe_means_what_the_shipped_one_means(name, tmp_path, monkeypatch):
    """Relative paths in a shipped recipe are relative to the file: copied anywhere, it must still load
    to the same values (a path like model.adapter: ../outputs/x would not)."""
    monkeypatch.chdir(tmp_path)
    copy = tmp_path / "somewhere" / "else" / f"{name}.yaml"
    copy.parent.mkdir(parents=True)
    shutil.copyfile(shipped.find(name), copy)
    assert Recipe.from_yaml(copy).resolved_values() == Recipe.from_yaml(shipped.find(name)).resolved_values()


def test_every_command_takes_a_shipped_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(["validate", "demo", "--set", "lora.rank=4"], monkeypatch, capsys)
    assert code == 0
    assert "rank: 4" in out
    # a file of that name here wins
    (tmp_path / "demo").write_text("lora:\n  rank: 5\n")
    code, out, _ = run_cli(["validate", "demo"], monkeypatch, capsys)
    assert code == 0
    assert "rank: 5" in out


def test_recipes_show_prints_the_file_as_shipped(monkeypatch, capsys):
    code, out, _ = run_cli(["recipes", "show", "llama3-8b-alpaca-24gb"], monkeypatch, capsys)
    assert code == 0
    assert out == (ROOT / "recipes" / "llama3-8b-alpaca-24gb.yaml").read_text()
    code, out, _ = run_cli(["recipes", "show", "accelerate/fsdp-qlora"], monkeypatch, capsys)
    assert out == (ROOT / "recipes" / "accelerate" / "fsdp-qlora.yaml").read_text()


def test_recipes_copy_writes_it_out_and_never_overwrites(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(["recipes", "copy", "demo"], monkeypatch, capsys)
    assert code == 0
    assert (tmp_path / "demo.yaml").read_text() == (ROOT / "recipes" / "demo.yaml").read_text()
    assert "qlora-kit train demo.yaml" in out
    (tmp_path / "demo.yaml").write_text("# my edits\n")
    code, _, err = run_cli(["recipes", "copy", "demo"], monkeypatch, capsys)
    assert code == 2
    assert "demo.yaml: already exists, not overwritten" in err
    assert len(err.strip().splitlines()) == 1
    assert (tmp_path / "demo.yaml").read_text() == "# my edits\n"
    # DEST as a folder (made when missing) or a file name; an accelerate config by its name
    code, _, _ = run_cli(["recipes", "copy", "accelerate/fsdp-qlora", "launch"], monkeypatch, capsys)
    assert code == 0
    assert (tmp_path / "launch" / "fsdp-qlora.yaml").is_file()
    code, _, _ = run_cli(["recipes", "copy", "demo-dpo", "a/b/mine.yaml"], monkeypatch, capsys)
    assert code == 0
    assert (tmp_path / "a" / "b" / "mine.yaml").read_text() == (
        ROOT / "recipes" / "demo-dpo.yaml"
    ).read_text()
    code, _, err = run_cli(["recipes", "copy", "nosuch"], monkeypatch, capsys)
    assert code == 2
    assert "nosuch: no shipped recipe of that name (there are: " in err and " demo, demo-dpo," in err


@pytest.mark.parametrize("existing", ["notes.txt", "mine.yaml", "folder-file/sub.yaml"])
def test_recipes_copy_onto_an_existing_file_is_one_line(tmp_path, monkeypatch, capsys, existing):
    """An existing DEST, whatever its suffix, is refused in one line and left as it was (a file with
    another suffix is the destination named, not a folder to make; a file in the way of a folder too)."""
    monkeypatch.chdir(tmp_path)
    for name in ("notes.txt", "mine.yaml", "folder-file"):
        (tmp_path / name).write_text("# mine\n")
    code, _, err = run_cli(["recipes", "copy", "demo", existing], monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ") and existing.split("/")[0] in err
    assert all(
        (tmp_path / name).read_text() == "# mine\n" for name in ("notes.txt", "mine.yaml", "folder-file")
    )


def host_memory_reading(monkeypatch, available: int) -> None:
    """psutil's reading of the host's available memory, as another machine (or moment) would give it."""
    reading = psutil.virtual_memory()._replace(available=available)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: reading)


def test_every_gpu_recipe_states_the_memory_it_is_written_for():
    """A recipe for a GPU (a hub model) states its GPU's memory, so that its plan on any machine budgets by
    it and not by the memory of the machine that reads it."""
    for path in RECIPES:
        recipe = Recipe.from_yaml(path)
        if not recipe.model.path.startswith("builtin:"):
            assert recipe.memory.budget_gb is not None, path.stem


def test_recipes_lists_the_same_under_two_memory_readings_in_seconds(monkeypatch, capsys):
    """The listing reads nothing of this machine's memory and plans nothing unless asked (red when it
    planned every recipe: 119 s here, and a GPU recipe's line followed the host's free memory)."""
    listings = []
    for available in (2**20, 2**40):  # 1 MiB free, then 1 TiB free
        host_memory_reading(monkeypatch, available)
        started = time.monotonic()
        code, out, _ = run_cli(["recipes"], monkeypatch, capsys)
        assert code == 0 and time.monotonic() - started < 10
        listings.append(out)
    assert listings[0] == listings[1]
    lines = {line.split()[0]: line for line in listings[0].splitlines()[1:] if line.split()}
    assert lines["llama3-8b-alpaca-fsdp-2x24gb"].endswith("24 GiB per GPU x 2")


def test_a_cuda_plan_on_a_machine_without_cuda_reads_no_host_memory(monkeypatch, tmp_path):
    """memory.chunked_loss auto planned for CUDA here (no GPU) without memory.budget_gb assumes no budget and
    says so: the same head under any reading of the host's memory (red when free_bytes("cuda") returned the
    host's available memory: 1 MiB free chose the chunked head, 1 TiB full logits)."""
    from qlora_kit.memory.loss_choice import choose_head, free_bytes

    assert not torch.cuda.is_available()
    recipe = Recipe.from_yaml(ROOT / "recipes" / "demo.yaml")
    assert recipe.memory.chunked_loss == "auto" and recipe.memory.budget_gb is None
    choices = []
    for available in (2**20, 2**40):
        host_memory_reading(monkeypatch, available)
        assert free_bytes("cuda")[0] is None
        assert free_bytes("cpu")[0] == available  # a CPU plan is this machine's: its memory is the budget
        choices.append(choose_head(recipe, "cuda"))
    assert choices[0] == choices[1] and not choices[0].chunked
    assert "assumed no budget" in choices[0].why


@pytest.mark.slow  # plans every shipped recipe once and one of each kind of line again (~40 s on 2 cores)
def test_recipes_lists_each_with_the_planners_memory(monkeypatch, capsys):
    """Each line's peak is the plan's with the loss head the run chooses (red when the listing planned
    memory.chunked_loss auto as the chunked head: Qwen3.5-9B listed at 11.54 GiB, planned and run with full
    logits at 20.01), and the same under another reading of this machine's memory (the listing read under
    1 MiB free, the reference under 1 TiB: red when a CUDA plan budgeted by the host's memory). Every recipe
    is listed with a peak; the reference plans again one recipe of each kind of line the listing wrote (its
    head, processes, experts' place, builtin or hub model: each kind is its own path through the listing),
    the one with the smallest peak, as planning all 25 twice cost half a minute for no other path."""
    host_memory_reading(monkeypatch, 2**20)
    code, out, _ = run_cli(["recipes", "--plan"], monkeypatch, capsys)
    assert code == 0
    host_memory_reading(monkeypatch, 2**40)
    lines = {line.split()[0]: line for line in out.splitlines()[1:] if line.split()}
    kinds: dict[tuple, tuple[float, Recipe, str]] = {}
    for path in RECIPES:
        recipe = Recipe.from_yaml(path)
        line = lines[path.stem]
        assert recipe.model.path in line
        assert recipe.data.source_list()[0].path in line
        peak, kind = listed_peak_and_kind(line, recipe)
        kinds[kind] = min(kinds.get(kind, (float("inf"),)), (peak, recipe, line), key=lambda k: k[0])
    assert len(kinds) >= 6, (
        kinds.keys()
    )  # builtin and hub models, chunked and full heads, FSDP, experts on host
    for _, recipe, line in kinds.values():
        assert_listed_as_planned(recipe, line)


def listed_peak_and_kind(line: str, recipe: Recipe) -> tuple[float, tuple]:
    """A listing line's peak (GiB) and its kind: the words of its plan that name a path through the listing."""
    found = re.search(
        r"([0-9.]+) GiB( per GPU on \d+)? \(checkpointing \S+?(, chunked loss|, full logits)?, bs ", line
    )
    assert found, line
    on_host = "experts on host" in line
    return float(found[1]), (bool(found[2]), found[3], on_host, recipe.model.path.startswith("builtin:"))


def assert_listed_as_planned(recipe: Recipe, line: str) -> None:
    from qlora_kit.memory.loss_choice import choose_head, with_head
    from qlora_kit.memory.planner import GIB, plan
    from qlora_kit.registries import objectives

    processes = 2 if recipe.train.fsdp else 1  # the shipped FSDP accelerate config's num_processes
    if objectives.of(recipe).chunked_head:
        head = choose_head(recipe, "cuda", processes=processes)
        recipe = with_head(recipe, head.chunked, head.chunk_tokens)
        assert ("chunked loss" if head.chunked else "full logits") in line, line
    peak = plan(recipe, device="cuda", processes=processes).chosen(recipe).peak
    assert f"{peak / GIB:.2f} GiB" in line, line
