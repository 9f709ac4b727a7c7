"""The CLI's logging: qlora_kit's lines on stderr, rich on a terminal and plain lines elsewhere."""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console


def configure_logging(errors: Console, verbosity: int = 0) -> None:
    """Log to ``errors`` (the console on stderr). ``verbosity`` -1 (--quiet): warnings and errors; 0:
    qlora_kit's INFO lines; 1 (-v): its DEBUG lines and transformers' INFO. Where stderr is not a
    terminal, the libraries' progress bars (their carriage returns) are off: a log file gets whole lines."""
    import warnings

    from rich.logging import RichHandler

    # peft still calls a transformers method that transformers 5 renamed; nothing for a user to act on.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    if not errors.is_terminal or verbosity < 0:
        progress_bars_off()

    if errors.is_terminal:
        handler: logging.Handler = RichHandler(console=errors, show_path=False, show_time=False, markup=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:  # logs and CI: one unwrapped line per message, so paths stay whole and grep finds them
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)-8s %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler], force=True)
    # Under accelerate/torchrun only the main process reports; the others stay quiet unless they fail.
    main_process = os.environ.get("RANK", "0") == "0"
    level = {-1: logging.WARNING, 0: logging.INFO, 1: logging.DEBUG}[verbosity]
    logging.getLogger("qlora_kit").setLevel(level if main_process else logging.WARNING)
    if verbosity > 0:
        logging.getLogger("transformers").setLevel(logging.INFO)


def progress_bars_off() -> None:
    import datasets
    import huggingface_hub
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
