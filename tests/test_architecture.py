"""The house's shape, enforced: one direction of dependency between the packages, no import cycle of any
kind, sub-packages whose ``__init__`` imports nothing and whose docstring names every module.

Every import counts: top-level, function-local and ``TYPE_CHECKING``-only (a cycle hidden in a function
is still a cycle a reader has to hold in their head, and the next refactor turns it into an ImportError).
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "qlora_kit"

# Bottom to top: a module may import only from its own layer's package (without a cycle) or from the
# layers below it. errors and registries are leaves every layer reads.
LAYERS = ["errors", "registries", "recipe", "model", "data", "memory", "training", "after", "cli", "testing"]
# The allowed arrows between the packages: a graph, not a line. Below its layer is not enough: after and
# training are siblings (both read the trained run; neither imports the other), so what both need (the
# rewards, the ignore index) sits below both. memory and data are siblings too (issue 72): the data's
# layout is chosen in data/, timed in memory/, and training/batch_layout.py joins the two.
LEAVES = {"errors", "registries"}
ALLOWED = {
    "errors": set(),
    "registries": set(),
    "recipe": LEAVES,
    "model": LEAVES | {"recipe"},
    "data": LEAVES | {"recipe", "model"},
    "memory": LEAVES | {"recipe", "model"},
    "training": LEAVES | {"recipe", "model", "data", "memory"},
    "after": LEAVES | {"recipe", "model", "data", "memory"},
    "cli": LEAVES | {"recipe", "model", "data", "memory", "training", "after"},
    # the tests' machinery (fault injectors, read-backs): above every layer, so none imports it
    "testing": LEAVES | {"recipe", "model", "data", "memory", "training", "after", "cli"},
}
ROOT_MODULES_MAX = 8


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """Each qlora_kit module -> the qlora_kit modules it imports, wherever the import statement is."""
    files = {module_name(f): f for f in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                # `from qlora_kit.model import adapters` imports the submodule, not only the package
                if target in files and target != name:
                    graph[name].add(target)
    return graph


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] in ("__main__",):
        return None  # the package root (public API) and __main__ sit above every layer
    return LAYERS.index(parts[1]) if parts[1] in LAYERS else -1


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component with more than one module (Tarjan), as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_no_import_cycle_of_any_kind():
    graph = import_graph()
    graph = {m: {t for t in ts if t != "qlora_kit"} for m, ts in graph.items()}  # the root is checked below
    assert find_cycles(graph) == []


def sibling_graph(graph: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    """The children of ``package`` (its modules and sub-packages, a sub-package standing for every module
    inside it, however deep) -> the children they import."""

    def child(module: str) -> str | None:
        if not module.startswith(package + "."):
            return None  # outside the package, or the package's own __init__
        return f"{package}.{module.removeprefix(package + '.').split('.')[0]}"

    siblings: dict[str, set[str]] = {}
    for module, targets in graph.items():
        mine = child(module)
        if mine is None:
            continue
        siblings.setdefault(mine, set())
        siblings[mine] |= {theirs for t in targets if (theirs := child(t)) not in (None, mine)}
    return siblings


def packages() -> list[str]:
    return sorted(module_name(init) for init in PACKAGE.rglob("__init__.py"))


def test_no_two_siblings_in_a_package_import_each_other():
    """Inside every package, its modules and sub-packages form no cycle, counting every import in a
    sub-package as its own: training/step and training/watch import in one direction only (issue 72:
    they imported each other through step/distributed.py, which a module-level check cannot see)."""
    graph = import_graph()
    cycles = {}
    for package in packages():
        found = find_cycles(sibling_graph(graph, package))
        if found:
            cycles[package] = found
    assert cycles == {}


def test_imports_point_down_the_layers():
    upward = []
    for module, targets in import_graph().items():
        mine = layer_of(module)
        if mine is None:
            continue
        assert mine >= 0, f"{module} is in no layer: put it in one of {LAYERS}"
        for target in targets:
            theirs = layer_of(target)
            if theirs is None or theirs > mine:
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_imports_follow_the_allowed_arrows_between_packages():
    """A package imports only the packages its arrows name (siblings such as after and training never
    each other); every layer has its arrows."""
    assert set(ALLOWED) == set(LAYERS)
    stray = []
    for module, targets in import_graph().items():
        mine = package_of(module)
        if mine is None:
            continue
        for target in targets:
            theirs = package_of(target)
            if theirs is not None and theirs != mine and theirs not in ALLOWED[mine]:
                stray.append(f"{module} -> {target}")
    assert stray == []


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_registries_and_errors_import_only_the_standard_library():
    """At module level: the recipe reads them, and ``import qlora_kit`` stays light. (A kernel's
    availability probe may import its library inside a function. A registry may read another registry,
    which is held to the same rule: the objective table names the metric keys.)"""
    import sys

    leaves = [PACKAGE / "errors.py", *sorted((PACKAGE / "registries").glob("*.py"))]
    for path in leaves:
        for node in _module_level(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name.startswith("qlora_kit.registries") and path.parent.name == "registries":
                    continue
                assert name.split(".")[0] in sys.stdlib_module_names, f"{path.name}: {name}"


def _module_level(body: list[ast.stmt]):
    """The statements run at import, descending into if/try blocks but not into functions or classes."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            if isinstance(node, (ast.If, ast.Try, ast.ExceptHandler)) and hasattr(node, field):
                yield from _module_level(getattr(node, field))


def test_every_format_refers_to_its_functions_directly():
    """data/formats.py's RENDERINGS has one line per format of the registry, each holding its functions
    (a reference a search finds, not a name looked up): a pair's render is preference.render_chosen."""
    from qlora_kit.data import formats
    from qlora_kit.registries.formats import FORMATS

    assert list(formats.RENDERINGS) == list(FORMATS)
    for name, rendering in formats.RENDERINGS.items():
        assert callable(rendering.prompt), name
        assert callable(rendering.render) or (FORMATS[name].pairs and rendering.render is None), name
    assert not [f for f in dataclasses.fields(FORMATS["alpaca"]) if f.type == "str" and f.name != "name"]


def test_every_checkpointing_context_is_a_function_the_code_refers_to():
    from qlora_kit.memory import checkpointing, selective
    from qlora_kit.registries import checkpointing as table

    with_context = [name for name, spec in table.POLICIES.items() if spec.context_fn]
    assert list(checkpointing.CONTEXT_FNS) == with_context == ["selective"]
    assert checkpointing.CONTEXT_FNS["selective"] is selective.context_fn


def string_lookups(path: Path) -> list[str]:
    """Where a module finds a function of its own package by a name it builds or reads: ``globals()``,
    ``getattr`` of a module or ``importlib.import_module`` with a computed name (``path:line``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        computed = node.args and not isinstance(node.args[-1 if name == "getattr" else 0], ast.Constant)
        if name == "globals" or (name == "import_module" and computed):
            found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {name}")
        elif name == "getattr" and len(node.args) >= 2 and isinstance(node.args[1], ast.JoinedStr):
            target = node.args[0]
            if isinstance(target, ast.Call) or getattr(target, "id", "") in ("module", "sys"):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} getattr")
    return found


# A library's own names, read lazily where the library declares them (STYLE: heavy imports stay lazy),
# and a user's reward function named in the recipe: not the package's functions.
LOOKUPS_OF_OTHERS = {
    "registries/optimizers.py": "bitsandbytes' optimizer classes, imported when a run builds one",
    "data/rewards.py": "a user's reward function, named in the recipe as module:function",
}


def test_no_registry_or_module_looks_a_function_up_by_string():
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        for hit in string_lookups(path)
        if str(path.relative_to(PACKAGE)) not in LOOKUPS_OF_OTHERS
    ]
    assert found == []


def test_the_string_lookup_check_sees_each_kind(tmp_path, monkeypatch):
    module = tmp_path / "qlora_kit" / "data" / "formats.py"
    module.parent.mkdir(parents=True)
    module.write_text(
        "import importlib\n"
        "def render(spec):\n"
        "    return globals()[spec.render]\n"
        "def load(named):\n"
        "    return importlib.import_module(named)\n"
    )
    monkeypatch.setitem(globals(), "PACKAGE", tmp_path / "qlora_kit")
    assert sorted(string_lookups(module)) == ["data/formats.py:3 globals", "data/formats.py:5 import_module"]


def test_the_root_holds_few_modules_and_sub_packages_import_nothing():
    assert len(list(PACKAGE.glob("*.py"))) <= ROOT_MODULES_MAX
    for init in PACKAGE.glob("**/__init__.py"):  # sub-sub-packages too (training/step, ...)
        if init.parent == PACKAGE:
            continue  # the public API
        tree = ast.parse(init.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], init
        doc = ast.get_docstring(tree) or ""
        modules = sorted(p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py")
        missing = [m for m in modules if f"{m}" not in doc]
        assert missing == [], f"{init.parent.name}/__init__.py's docstring does not name {missing}"


def test_the_checker_sees_each_kind_of_import(tmp_path, monkeypatch):
    """The graph counts function-local and TYPE_CHECKING imports, and finds a two-module cycle."""
    root = tmp_path / "qlora_kit"
    (root / "memory").mkdir(parents=True)
    (root / "memory" / "__init__.py").write_text('"""a, b"""\n')
    (root / "memory" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from qlora_kit.memory import b\n"
    )
    (root / "memory" / "b.py").write_text("def f():\n    from qlora_kit.memory.a import x\n")
    (root / "errors.py").write_text("")
    (root / "data.py").write_text("")
    (root / "memory" / "c.py").write_text("def g():\n    from qlora_kit.cli import views\n")
    (root / "cli").mkdir()
    (root / "cli" / "__init__.py").write_text("")
    (root / "cli" / "views.py").write_text("")
    monkeypatch.setitem(globals(), "PACKAGE", root)
    graph = import_graph()
    assert graph["qlora_kit.memory.a"] == {"qlora_kit.memory.b", "qlora_kit.memory"}
    assert find_cycles(graph) == [["qlora_kit.memory.a", "qlora_kit.memory.b"]]
    assert layer_of("qlora_kit.cli.views") > layer_of("qlora_kit.memory.c")


def test_the_checker_sees_two_sub_packages_that_import_each_other(tmp_path, monkeypatch):
    """No module cycle, yet a cycle of sub-packages: step/a imports watch/b, watch/c imports step/d."""
    root = tmp_path / "qlora_kit"
    files = {
        "training/step/a.py": "from qlora_kit.training.watch import b\n",
        "training/step/d.py": "",
        "training/watch/b.py": "",
        "training/watch/c.py": "def f():\n    from qlora_kit.training.step.d import x\n",
        "training/pipeline.py": "from qlora_kit.training.step import a\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    for folder in ("", "training", "training/step", "training/watch"):
        (root / folder / "__init__.py").write_text("")
    monkeypatch.setitem(globals(), "PACKAGE", root)
    graph = import_graph()
    assert find_cycles(graph) == []
    assert find_cycles(sibling_graph(graph, "qlora_kit.training")) == [
        ["qlora_kit.training.step", "qlora_kit.training.watch"]
    ]
    assert find_cycles(sibling_graph(graph, "qlora_kit")) == []


# What only the tests' machinery may name: the injectors, their globals and their environment variables
FAULT_NAMES = {"oom_faults", "allocator_faults", "INJECTOR", "ALLOCATIONS", "reload_cap", "EnvFaults"}


def fault_references(path: Path) -> list[str]:
    """Where a module names a fault injector, imports the testing package, reads an injector's
    environment variable or installs faults: ``path:line name``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or "", *(a.name for a in node.names)]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            seam = isinstance(node.value, ast.Name) and node.value.id == "fault_seam"
            names = ["fault_seam.install" if seam and node.attr == "install" else node.attr]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = ["QLORA_KIT_OOM"] if "QLORA_KIT_OOM" in node.value else []
        hits = [n for n in names if n.split(".")[-1] in FAULT_NAMES or n.startswith("qlora_kit.testing")]
        hits += [n for n in names if n in ("QLORA_KIT_OOM", "fault_seam.install")]
        found += [f"{path.relative_to(PACKAGE)}:{node.lineno} {n}" for n in hits]
    return found


def test_no_fault_hook_on_the_run_path_only_the_one_seam():
    """The fault injectors live in qlora_kit/testing/ and enter a run only through memory/fault_seam.py,
    which a test installs: no other module imports or names them, reads their environment, or installs
    faults; and the seam's own faults do nothing."""
    from qlora_kit.memory import accounting, fault_seam

    outside = [f for f in PACKAGE.rglob("*.py") if "testing" not in f.relative_to(PACKAGE).parts]
    found = [hit for path in outside for hit in fault_references(path)]
    assert found == []
    suites = fault_seam.install(None)  # as every run outside the tests
    try:
        assert fault_seam.run_built(object()) is None and fault_seam.failure_figures() == ""
        assert accounting.STEP_OBSERVERS == []  # a training forward pass reports to no one
    finally:
        fault_seam.install(suites)
    assert [suites] == accounting.STEP_OBSERVERS


def test_the_fault_check_sees_a_hook_on_the_run_path(tmp_path, monkeypatch):
    """A module of the run that imports an injector, or reads its cap from the environment, is found."""
    root = tmp_path / "qlora_kit"
    (root / "training").mkdir(parents=True)
    step = root / "training" / "step.py"
    step.write_text(
        "from qlora_kit.testing.oom_faults import INJECTOR\n"
        "import os\nCAP = os.environ.get('QLORA_KIT_OOM_CAP_BYTES')\n"
        "from qlora_kit.memory import fault_seam\nfault_seam.install(None)\n"
    )
    monkeypatch.setitem(globals(), "PACKAGE", root)
    assert fault_references(step) == [
        "training/step.py:1 qlora_kit.testing.oom_faults",
        "training/step.py:1 INJECTOR",
        "training/step.py:3 QLORA_KIT_OOM",
        "training/step.py:5 fault_seam.install",
    ]


# STYLE's size: modules up to ~400 lines. The families table is the one module allowed past it (one
# entry per family); a module split leaves the list.
MODULE_LINES_MAX = 400
OVER_THE_SIZE = {
    "registries/families.py": "the table itself",
}


def modules_over(root: Path, most: int) -> dict[str, int]:
    """Each module of ``root`` longer than ``most`` lines, with its length."""
    lengths = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    return {name: lines for name, lines in lengths.items() if lines > most}


def test_no_module_is_over_400_lines_but_the_families_table():
    over = modules_over(PACKAGE, MODULE_LINES_MAX)
    assert set(over) - set(OVER_THE_SIZE) == set(), over
    assert set(OVER_THE_SIZE) - set(over) == set(), "split already: leaves OVER_THE_SIZE"


def test_the_size_check_sees_a_long_module(tmp_path):
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / "long.py").write_text("x = 1\n" * 401)
    (tmp_path / "short.py").write_text("x = 1\n" * 400)
    assert modules_over(tmp_path, MODULE_LINES_MAX) == {"step/long.py": 401}
