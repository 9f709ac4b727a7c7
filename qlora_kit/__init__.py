"""qlora_kit: QLoRA fine-tuning from a typed recipe.

    from qlora_kit import Recipe, train
    result = train(Recipe.from_yaml("recipes/demo.yaml"))

Heavy libraries (torch, transformers, peft, bitsandbytes) load on first use, so importing the
package and ``qlora-kit --help`` stay fast.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qlora_kit.errors import RecipeError
from qlora_kit.recipe.recipe import Recipe

if TYPE_CHECKING:
    from qlora_kit.training.pipeline import TrainResult

__all__ = ["Recipe", "RecipeError", "TrainResult", "evaluate", "export", "generate", "merge", "show", "train"]
__version__ = "0.1.0"
# The pipeline module is named pipeline, not train: a submodule named train would replace this
# package's train() function as an attribute the moment it is imported.


class _DropOptionalKernelNotice(logging.Filter):
    # bitsandbytes' CPU backend tries to fetch an optional kernel package from a hub when imported and
    # logs a warning when it is absent; its built-in kernels are correct, so the notice is only noise.
    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropOptionalKernelNotice())


def train(
    recipe: Recipe, overwrite: bool = False, resume: bool | str = False, callbacks: list | None = None
) -> TrainResult:
    """Run the whole QLoRA pipeline for ``recipe``; see ``qlora_kit.training.pipeline.run``."""
    from qlora_kit.training.pipeline import run

    return run(recipe, overwrite=overwrite, resume=resume, callbacks=callbacks)


def evaluate(recipe: Recipe | None = None, adapter_dir: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """Loss, perplexity and exact match on the validation set; see ``qlora_kit.after.evaluate.evaluate``."""
    from qlora_kit.after.evaluate import evaluate as run_evaluate

    return run_evaluate(recipe, adapter_dir, **kwargs)


def generate(adapter_dir: str | None, prompts: list[str], **kwargs: Any) -> list[str]:
    """Answers from a trained adapter; see ``qlora_kit.after.generate.generate``."""
    from qlora_kit.after.generate import generate as run_generate

    return run_generate(adapter_dir, prompts, **kwargs)


def merge(adapter_dir: str, out_dir: str, **kwargs: Any):
    """Merge an adapter into its base and export it, drift-checked; see ``qlora_kit.after.merge.merge_adapter``."""
    from qlora_kit.after.merge import merge_adapter

    return merge_adapter(adapter_dir, out_dir, **kwargs)


def export(adapter_dir: str, to: str = "merged", **kwargs: Any):
    """Export a run as a merged folder or a GGUF, parity-checked; see ``qlora_kit.after.export.export``."""
    from qlora_kit.after.export import export as run_export

    return run_export(adapter_dir, to, **kwargs)


def show(run_dir: str | Path, plot: bool = True) -> Path | None:
    """Print a run's summary from its folder and write its loss.png; see ``qlora_kit.cli.views.show_run_folder``."""
    from rich.console import Console

    from qlora_kit.cli.views import show_run_folder as show_run

    return show_run(run_dir, Console(), plot=plot)


def __getattr__(name: str) -> Any:
    if name == "TrainResult":
        from qlora_kit.training.pipeline import TrainResult

        return TrainResult
    raise AttributeError(f"module 'qlora_kit' has no attribute {name!r}")
