"""qlora_kit: QLoRA fine-tuning from a typed recipe.

    from qlora_kit import Recipe, train
    result = train(Recipe.from_yaml("recipes/demo.yaml"))

Heavy libraries (torch, transformers, peft, bitsandbytes) load on first use, so importing the
package and ``qlora-kit --help`` stay fast.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from qlora_kit.recipe import Recipe, RecipeError

if TYPE_CHECKING:
    from qlora_kit.pipeline import TrainResult

__all__ = ["Recipe", "RecipeError", "TrainResult", "train"]
__version__ = "0.1.0"
# The pipeline module is named pipeline, not train: a submodule named train would replace this
# package's train() function as an attribute the moment it is imported.


class _DropOptionalKernelNotice(logging.Filter):
    # bitsandbytes' CPU backend tries to fetch an optional kernel package from a hub when imported and
    # logs a warning when it is absent; its built-in kernels are correct, so the notice is only noise.
    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_DropOptionalKernelNotice())


def train(recipe: Recipe, overwrite: bool = False) -> TrainResult:
    """Run the whole QLoRA pipeline for ``recipe``; see ``qlora_kit.pipeline.run``."""
    from qlora_kit.pipeline import run

    return run(recipe, overwrite=overwrite)


def __getattr__(name: str) -> Any:
    if name == "TrainResult":
        from qlora_kit.pipeline import TrainResult

        return TrainResult
    raise AttributeError(f"module 'qlora_kit' has no attribute {name!r}")
