"""``python -m qlora_kit`` is ``qlora-kit``."""

from qlora_kit.cli.app import main

if __name__ == "__main__":
    main()
