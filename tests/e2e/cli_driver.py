"""Runs several qlora-kit command lines in one process, so a group of CLI cases pays for importing
torch and transformers once:

    python tests/e2e/cli_driver.py '{"case name": ["train", "recipe.yaml", "--set", "..."], ...}'

Each case is the real ``qlora_kit.cli.app.main`` with its own ``sys.argv``; between cases the driver writes
``=== case NAME`` and ``=== exit CODE`` lines to stderr, where the case's own output goes too.
"""

from __future__ import annotations

import json
import sys

from qlora_kit.cli import app as cli

for name, argv in json.loads(sys.argv[1]).items():
    print(f"=== case {name}", file=sys.stderr, flush=True)
    sys.argv = ["qlora-kit", *argv]
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    print(f"=== exit {code}", file=sys.stderr, flush=True)
