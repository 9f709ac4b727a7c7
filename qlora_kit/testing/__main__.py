"""``python -m qlora_kit.testing ARGS`` is ``qlora-kit ARGS`` with the tests' faults installed (faults.py):
a run in another process (torchrun's) under the caps its environment sets."""

from qlora_kit.cli.app import main
from qlora_kit.testing import faults

if __name__ == "__main__":
    faults.install()
    main()
