#!/usr/bin/env bash
# Regenerate the hashed lock files from pyproject.toml (run after changing dependencies):
#   docker/requirements.lock      torch 2.13.0 from PyPI (the CUDA build): what a user's GPU image installs
#   docker/requirements-cpu.lock  the same versions with torch's CPU build (2.13.0+cpu, from a local
#                                 wheel folder): what CI builds its image from
# Each keeps the versions it already pins where pyproject.toml still allows them; UPGRADE=1 takes the
# newest releases it allows instead (what a fresh `pip install -e .` gets, and what CI's suite runs on:
# .ci/run prints the lock's drift from them before the tests).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-/opt/wheels}
common=(pyproject.toml docker/build-requirements.in --generate-hashes --python-version 3.11
        --python-platform x86_64-manylinux_2_28 --no-strip-markers --quiet ${UPGRADE:+--upgrade})
uv pip compile "${common[@]}" --override docker/gpu-override.txt -o docker/requirements.lock
uv pip compile "${common[@]}" --find-links "$WHEELS" --override docker/cpu-override.txt -o docker/requirements-cpu.lock
grep -c '==' docker/requirements.lock docker/requirements-cpu.lock
