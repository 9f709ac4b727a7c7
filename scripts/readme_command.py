"""Print one of the commands the README opens with (its first bash block: 1 runs the demo, 2 the tests).

    python3 scripts/readme_command.py 2

.ci/run runs the second one as it stands there, so CI proves what a newcomer who copies it gets; the
README holds the one copy (tests/test_readme_commands.py checks both commands' shape).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def commands(text: str) -> list[str]:
    """The command lines of the README's first ```bash block (comments and blank lines left out)."""
    block = re.search(r"```bash\n(.*?)```", text, re.DOTALL)
    if block is None:
        raise SystemExit("README.md has no ```bash block")
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


if __name__ == "__main__":
    print(commands(README.read_text(encoding="utf-8"))[int(sys.argv[1]) - 1])
