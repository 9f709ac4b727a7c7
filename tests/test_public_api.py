"""The public surface users build on stays as it is: the package's names and signatures, the CLI's
commands, the recipe's sections, and an import that loads no heavy library."""

import inspect
import subprocess
import sys

from qlora_kit import Recipe
from qlora_kit.cli.app import app


def test_package_exports_and_signatures():
    # Importing the modules behind them must not replace the package's functions (a module named
    # qlora_kit/evaluate.py would: submodules become package attributes on import).
    import qlora_kit.after.evaluate
    import qlora_kit.after.export
    import qlora_kit.after.generate
    import qlora_kit.after.merge
    import qlora_kit.training.pipeline

    assert sorted(qlora_kit.__all__) == [
        "Recipe",
        "RecipeError",
        "TrainResult",
        "evaluate",
        "export",
        "generate",
        "merge",
        "show",
        "train",
    ]
    assert list(inspect.signature(qlora_kit.train).parameters) == [
        "recipe",
        "overwrite",
        "resume",
        "callbacks",
    ]
    assert list(inspect.signature(qlora_kit.evaluate).parameters) == ["recipe", "adapter_dir", "kwargs"]
    assert list(inspect.signature(qlora_kit.generate).parameters) == ["adapter_dir", "prompts", "kwargs"]
    assert list(inspect.signature(qlora_kit.merge).parameters) == ["adapter_dir", "out_dir", "kwargs"]
    assert list(inspect.signature(qlora_kit.export).parameters) == ["adapter_dir", "to", "kwargs"]
    assert list(inspect.signature(qlora_kit.show).parameters) == ["run_dir", "plot"]
    assert qlora_kit.TrainResult.__name__ == "TrainResult"


def test_cli_commands_and_recipe_sections():
    commands = sorted(command.name or command.callback.__name__ for command in app.registered_commands)
    assert commands == [
        "chat",
        "data",
        "doctor",
        "eval",
        "export",
        "generate",
        "merge",
        "plan",
        "show",
        "train",
        "validate",
    ]
    sections = ["model", "quant", "lora", "memory", "optimizer", "data", "train", "preference", "grpo"]
    assert list(Recipe.model_fields) == sections


def test_import_and_help_load_no_heavy_library():
    code = (
        "import sys, qlora_kit, qlora_kit.cli.app; "
        "print(sorted(m for m in ('torch', 'transformers', 'peft', 'datasets', 'bitsandbytes') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
