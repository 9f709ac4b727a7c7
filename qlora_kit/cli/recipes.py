"""``qlora-kit recipes``: the recipes shipped inside the package, for a user who installed it.

    qlora-kit recipes                      # one line each: model, data, the GPU memory it is written for
    qlora-kit recipes --plan               # and the peak the planner predicts for it (a few s per recipe)
    qlora-kit recipes show demo            # print one (pipe it, or read it)
    qlora-kit recipes copy demo [DEST]     # write it out for editing; never overwrites

Every other command takes a shipped recipe's name where it takes a recipe path (``recipe.shipped``).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console

from qlora_kit.cli.exits import user_errors
from qlora_kit.errors import RecipeError
from qlora_kit.recipe import shipped
from qlora_kit.recipe.base import one_line
from qlora_kit.recipe.recipe import Recipe
from qlora_kit.registries import checkpointing as table

app = typer.Typer(
    name="recipes",
    help="The shipped recipes: list them (with the GPU memory each is written for), show one, copy one out.",
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()

NameArg = Annotated[str, typer.Argument(help="A shipped recipe's name (qlora-kit recipes lists them).")]


@app.callback(invoke_without_command=True)
@user_errors
def list_recipes(
    context: typer.Context,
    with_plans: Annotated[
        bool,
        typer.Option(
            "--plan",
            help="Also plan each recipe's peak GPU memory (the planner traces each model: seconds each).",
        ),
    ] = False,
) -> None:
    """One line per shipped recipe: model, data, the GPU memory it is written for (memory.budget_gb) and,
    with --plan, the peak the planner predicts for it. The same on every machine: nothing here reads this
    machine's memory (a GPU recipe is planned against its own memory.budget_gb)."""
    if context.invoked_subcommand is not None:
        return
    names = shipped.recipe_names()
    recipes = {name: Recipe.from_yaml(shipped.folder() / f"{name}{shipped.SUFFIX}") for name in names}
    rows = [
        (name, r.model.path, ", ".join(s.path for s in r.data.source_list()), written_for(r))
        for name, r in recipes.items()
    ]
    header = ("NAME", "MODEL", "DATA", "WRITTEN FOR")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    line = "  ".join(f"{{:<{w}}}" for w in widths) + ("  {}" if with_plans else "")
    title = line.format(*header, "GPU MEMORY (planned peak)") if with_plans else line.format(*header)
    console.print(title.rstrip(), style="bold", highlight=False, soft_wrap=True)
    for row in rows:
        # planning takes a second or more per recipe: each line is printed as soon as it is known
        text = line.format(*row, planned_memory(recipes[row[0]])) if with_plans else line.format(*row)
        console.print(text.rstrip(), highlight=False, markup=False, soft_wrap=True)
    console.print(
        f"accelerate configs (for train.fsdp recipes): {', '.join(shipped.accelerate_names())}\n"
        + ("" if with_plans else "qlora-kit recipes --plan adds each one's planned peak; ")
        + "qlora-kit train NAME runs one as shipped; qlora-kit recipes copy NAME writes it out for editing",
        style="dim",
        highlight=False,
        soft_wrap=True,
    )


def written_for(recipe: Recipe) -> str:
    """The GPU memory the recipe states it is written for (memory.budget_gb), per GPU."""
    if recipe.memory.budget_gb is None:
        return "-"
    per_gpu = f" per GPU x {fsdp_processes()}" if recipe.train.fsdp else ""
    return f"{recipe.memory.budget_gb:g} GiB{per_gpu}"


def planned_memory(recipe: Recipe) -> str:
    """The planner's peak per GPU for the checkpointing policy and the loss head the recipe trains with
    (memory.chunked_loss auto resolved as ``qlora-kit plan`` and the run resolve it)."""
    from qlora_kit.memory.auto import choose_layers
    from qlora_kit.memory.planner import GIB, policy_name
    from qlora_kit.training.recipe_plan import plan_recipe

    processes = fsdp_processes() if recipe.train.fsdp else 1
    try:
        with warnings.catch_warnings():
            # transformers' deprecation notes from building the meta model are not the user's business here
            warnings.simplefilter("ignore", FutureWarning)
            planned = plan_recipe(recipe, "cuda", processes=processes)
    except Exception as exc:  # a listing goes on: one recipe that cannot be planned says why on its line
        return f"cannot plan ({exc.__class__.__name__}: {one_line(str(exc))[:160]})"
    recipe, the_plan = planned.recipe, planned.plan
    memory = recipe.memory
    if table.planned(memory.checkpointing):
        row = choose_layers(recipe, memory.budget_gb, the_plan)[0]
        name, peak = row.policy, row.peak
    else:
        name = policy_name(memory.checkpointing, memory.every_n)
        peak = next(p.peak for p in the_plan.policies if p.policy == name)
    per_gpu = f" per GPU on {processes}" if processes > 1 else ""
    head = "" if planned.head is None else ", chunked loss" if planned.head.chunked else ", full logits"
    on_host = (
        ", experts on host" if the_plan.experts_on_host else ""
    )  # memory.experts_on_host (auto: as planned)
    return f"{peak / GIB:.2f} GiB{per_gpu} (checkpointing {name}{head}, bs {the_plan.batch} x {the_plan.seq}{on_host})"


def fsdp_processes() -> int:
    """GPUs an FSDP recipe is planned over: the shipped FSDP accelerate config's num_processes."""
    for name in shipped.accelerate_names():
        config = yaml.safe_load(shipped.find(name).read_text(encoding="utf-8")) or {}
        if str(config.get("distributed_type", "")).upper() == "FSDP":
            return int(config.get("num_processes", 1))
    return 1


@app.command()
@user_errors
def show(name: NameArg) -> None:
    """Print a shipped recipe (or accelerate config) as it is shipped, comments included."""
    sys.stdout.write(_shipped_file(name).read_text(encoding="utf-8"))


@app.command()
@user_errors
def copy(
    name: NameArg,
    dest: Annotated[
        Path | None,
        typer.Argument(
            help="A .yaml file, or a folder, to write (default: NAME.yaml here). Never overwritten."
        ),
    ] = None,
) -> None:
    """Write a shipped recipe (or accelerate config) out for editing; refuses to overwrite a file."""
    source = _shipped_file(name)
    target = dest or Path(source.name)
    if target.is_dir() or (target.suffix not in (".yaml", ".yml") and not target.exists()):
        target = target / source.name  # a folder, made when missing (an existing file is refused below)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file where a folder should be
        raise RecipeError(f"{target.parent}: cannot make the folder ({exc.strerror})") from None
    try:
        with target.open("x", encoding="utf-8") as out:  # "x": fails when the file exists
            out.write(source.read_text(encoding="utf-8"))
    except FileExistsError:
        raise RecipeError(f"{target}: already exists, not overwritten (give another DEST)") from None
    except OSError as exc:
        raise RecipeError(f"{target}: cannot write ({exc.strerror})") from None
    if source.stem in shipped.recipe_names():
        use = f"edit it, then: qlora-kit train {target}"
    else:
        use = f"launch with: accelerate launch --config_file {target} ..."
    console.print(f"wrote {target}; {use}", highlight=False, markup=False, soft_wrap=True)


def _shipped_file(name: str) -> Path:
    found = shipped.find(name)
    if found is None:
        known = ", ".join(shipped.recipe_names() + shipped.accelerate_names())
        raise RecipeError(f"{name}: no shipped recipe of that name (there are: {known})")
    return found
