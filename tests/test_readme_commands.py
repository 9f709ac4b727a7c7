"""The README opens with two commands for a fresh machine, and CI runs the second as it stands there
(.ci/run reads it with scripts/readme_command.py): a README edit that CI would not run, or a CI that
installs what a newcomer does not (last round: the lock), is red here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "


sys.path.insert(0, str(ROOT / "scripts"))
from readme_command import README, commands  # noqa: E402


def readme_command(n: int) -> str:
    return commands(README.read_text(encoding="utf-8"))[n - 1]


def test_the_readme_opens_with_the_demo_and_the_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.index("```bash") < readme.index("\n## ")  # before the first section
    assert readme_command(1) == VENV + "pip install -e . && qlora-kit train recipes/demo.yaml --overwrite"
    assert readme_command(2) == VENV + 'pip install -e ".[dev]" && python -m pytest -q'


def test_ci_runs_the_readmes_test_command_and_no_lock_before_it():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "scripts/readme_command.py 2" in ci and 'eval "$install"' in ci
    before_tests = ci[: ci.index("python -m pytest -q\n")]
    # the lock is the image's (scripts/build_image.sh installs and checks it); the suite runs what a user gets
    assert not re.search(r"pip install[^\n]*requirements[^\n]*\.lock", before_tests)
    assert "check_lock.py --drift" in before_tests


def test_ci_compiles_into_an_inductor_cache_of_its_own():
    """CI runs on the submitting session's machine with its leftovers: an inductor cache another ISA wrote
    crashed every compile test there (stop 88). The suite must start on an empty one, as a newcomer's."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    made = ci.index("TORCHINDUCTOR_CACHE_DIR=$(mktemp -d")
    assert made < ci.index("export TORCHINDUCTOR_CACHE_DIR") < ci.index('eval "$install"')


def test_a_run_held_to_one_isa_compiles_into_that_isas_cache():
    """tests/conftest.py gives a suite run under ATEN_CPU_CAPABILITY its own inductor cache, unless the
    shell named one: torch's FX graph cache keys leave the ISA out."""
    from tests.conftest import inductor_cache_for

    avx2 = inductor_cache_for({"ATEN_CPU_CAPABILITY": "avx2"})
    assert avx2 and avx2.endswith("_avx2") and avx2 != inductor_cache_for({"ATEN_CPU_CAPABILITY": "avx512"})
    assert inductor_cache_for({}) is None  # torch's own folder, where the ISA is the machine's
    assert inductor_cache_for({"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CACHE_DIR": "/x"}) is None


def test_the_suites_datasets_cache_is_removed_by_the_process_that_made_it(tmp_path):
    """tests/conftest.py makes HF_DATASETS_CACHE a new folder when the shell names none, and the process
    that made it removes it at exit; a process that inherits the variable (an xdist worker, a process a
    test starts) leaves it to its maker (runs left their arrow files in /tmp before)."""
    show = "import os, tests.conftest; print(os.environ['HF_DATASETS_CACHE'])"
    environ = {k: v for k, v in os.environ.items() if k != "HF_DATASETS_CACHE"} | {"TMPDIR": str(tmp_path)}
    made = subprocess.run([sys.executable, "-c", show], cwd=ROOT, env=environ, capture_output=True, text=True)
    assert made.returncode == 0, made.stderr[-2000:]
    folder = Path(made.stdout.strip())
    assert folder.parent == tmp_path and folder.name.startswith("qlora-kit-datasets-")
    assert not folder.exists()  # removed at the exit of the process that made it
    inherited = tmp_path / "named-by-the-shell"
    inherited.mkdir()
    kept = subprocess.run(
        [sys.executable, "-c", show], cwd=ROOT, env=environ | {"HF_DATASETS_CACHE": str(inherited)}
    )
    assert kept.returncode == 0 and inherited.is_dir()
