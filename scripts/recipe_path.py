"""How far the recipe travels: the functions it reaches from ``training/pipeline.py:run``, counted statically.

    python scripts/recipe_path.py                 # this checkout's qlora_kit/
    python scripts/recipe_path.py --root DIR      # another checkout's (e.g. a `git worktree` of an old commit)
    python scripts/recipe_path.py --list          # each stop, and each climb back up a layer

How it counts (an AST walk, no import): a *stop* is a function of the package that receives the recipe or a
section of it (``recipe``, ``recipe.data``, ``run.recipe.memory``, ``recipe.data.sources``; not a value in
one, ``recipe.train.seed``) as an argument, starting from ``run``'s ``recipe``. Inside a function the names
that hold it are its parameters that received it and local names assigned from them (``memory =
recipe.memory``); a call passes it on when an argument is one of those names, a section of one, or any
``X.recipe`` (a resolved run's, a built run's), and the callee is found by the name it is called by: a function of the same
module, one imported by name, ``module.function`` of an imported module, or a class (its ``__init__``).
Methods called on the recipe itself (``recipe.to_yaml()``) are the recipe's own code, not a stop. A *file* is
a module with at least one stop; a *climb* is a call that passes the recipe to a module of a higher layer
than the caller's (cli > after > training > memory > data > model > recipe > registries, errors).
Each function counts once, whatever reaches it.
"""

from __future__ import annotations

import argparse
import ast
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["errors", "registries", "recipe", "model", "data", "memory", "training", "after", "cli"]
START = ("qlora_kit.training.pipeline", "run", "recipe")


def module_name(path: Path, package: Path) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int:
    """The module's layer (the package root above every layer)."""
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else len(LAYERS)


class Index:
    """Every module's functions (``name`` and ``Class.method``) and the names its imports bind."""

    def __init__(self, package: Path) -> None:
        self.functions: dict[tuple[str, str], ast.FunctionDef] = {}
        self.classes: dict[tuple[str, str], ast.ClassDef] = {}
        self.imports: dict[str, dict[str, tuple[str, str | None]]] = {}
        for path in sorted(package.rglob("*.py")):
            module = module_name(path, package)
            tree = ast.parse(path.read_text())
            self.imports[module] = self._imports(tree, module)
            for node in tree.body:
                if isinstance(node, ast.FunctionDef):
                    self.functions[(module, node.name)] = node
                elif isinstance(node, ast.ClassDef):
                    self.classes[(module, node.name)] = node
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef):
                            self.functions[(module, f"{node.name}.{item.name}")] = item

    @staticmethod
    def _imports(tree: ast.Module, module: str) -> dict[str, tuple[str, str | None]]:
        """local name -> (module, attribute or None for the module itself), function-local imports too."""
        bound: dict[str, tuple[str, str | None]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qlora_kit"):
                for alias in node.names:
                    bound[alias.asname or alias.name] = (node.module, alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("qlora_kit") and alias.asname:
                        bound[alias.asname] = (alias.name, None)
        return bound

    def resolve(self, module: str, func: ast.expr) -> tuple[str, str] | None:
        """The (module, function) a call's callee names, or None (a library's, a method's)."""
        if isinstance(func, ast.Name):
            return self._named(module, func.id)
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            target = self.imports.get(module, {}).get(func.value.id)
            if target is None:
                return None
            owner = target[0] if target[1] is None else f"{target[0]}.{target[1]}"
            return self._in(owner, func.attr)
        return None

    def _named(self, module: str, name: str) -> tuple[str, str] | None:
        if (module, name) in self.functions:
            return (module, name)
        if (module, name) in self.classes:
            return (module, f"{name}.__init__") if (module, f"{name}.__init__") in self.functions else None
        target = self.imports.get(module, {}).get(name)
        if target is None or target[1] is None:
            return None
        return self._in(target[0], target[1])

    def _in(self, owner: str, name: str) -> tuple[str, str] | None:
        if (owner, name) in self.functions:
            return (owner, name)
        if (owner, f"{name}.__init__") in self.functions:
            return (owner, f"{name}.__init__")
        return None


def section_fields(package: Path) -> set[str]:
    """The recipe's fields that hold a section (``data``, ``memory``, ``data.sources``...): read from the
    annotations of recipe/'s ``Section`` classes that name a ``...Section``."""
    fields = set()
    for path in (package / "recipe").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            annotated = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            if annotated and "Section" in ast.unparse(node.annotation):
                fields.add(node.target.id)
    return fields


def recipe_part(expr: ast.expr, names: set[str], sections: set[str]) -> bool:
    """``expr`` is the recipe or one of its sections: a name in ``names`` or ``X.recipe``, then section
    fields only (``recipe.data.sources``, ``run.recipe.memory``); a value inside one (``recipe.train.seed``)
    is not the recipe travelling."""
    chain = []
    while isinstance(expr, ast.Attribute):
        chain.insert(0, expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return False
    if expr.id not in names:
        if "recipe" not in chain:
            return False
        chain = chain[len(chain) - chain[::-1].index("recipe") :]
    return all(attr in sections for attr in chain)


def parameters(node: ast.FunctionDef, method: bool) -> list[str]:
    names = [a.arg for a in [*node.args.posonlyargs, *node.args.args]]
    return names[1:] if method and names and names[0] in ("self", "cls") else names


def walk(index: Index, start: tuple[str, str, str], sections: set[str]):
    """(stops: {(module, function)}, climbs: [(caller, callee)])."""
    carrying: dict[tuple[str, str], set[str]] = {(start[0], start[1]): {start[2]}}
    queue = deque([(start[0], start[1])])
    climbs: set[tuple[tuple[str, str], tuple[str, str]]] = set()
    while queue:
        here = queue.popleft()
        node = index.functions[here]
        names = set(carrying[here])
        for assign in (n for n in ast.walk(node) if isinstance(n, ast.Assign)):
            if recipe_part(assign.value, names, sections):
                names |= {t.id for t in assign.targets if isinstance(t, ast.Name)}
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            target = index.resolve(here[0], call.func)
            if target is None:
                continue
            params = parameters(index.functions[target], "." in target[1])
            received = {
                params[i]
                for i, a in enumerate(call.args)
                if i < len(params) and recipe_part(a, names, sections)
            }
            received |= {k.arg for k in call.keywords if k.arg and recipe_part(k.value, names, sections)}
            if not received:
                continue
            if layer(target[0]) > layer(here[0]):
                climbs.add((here, target))
            known = carrying.setdefault(target, set())
            if not received <= known:
                known |= received
                queue.append(target)
    return set(carrying), sorted(climbs)


def count(root: Path) -> tuple[int, int, int, set, list]:
    package = root / "qlora_kit"
    stops, climbs = walk(Index(package), START, section_fields(package))
    return len(stops), len({module for module, _ in stops}), len(climbs), stops, climbs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="a checkout holding qlora_kit/")
    parser.add_argument("--list", action="store_true", help="each stop and each climb")
    options = parser.parse_args()
    stops, files, climb_count, found, climbs = count(options.root)
    if options.list:
        for module, function in sorted(found):
            print(f"stop  {module}:{function}")
        for (a, b), (c, d) in climbs:
            print(f"climb {a}:{b} -> {c}:{d}")
    print(
        f"{stops} stops in {files} files, {climb_count} climbs back up a layer (from {START[0]}:{START[1]})"
    )


if __name__ == "__main__":
    main()
