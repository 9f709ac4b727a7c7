#!/usr/bin/env bash
# The GPU check for a session lent the H200 (one call of the device tool, within 9 minutes):
#   bash benchmarks/fetch_gpu_wheels.sh                                # here, once: wheels into .whl/
#   device run: command "bash benchmarks/gpu_check.sh", carry [".whl"], timeout_s 595
# Installs the carried wheels into /tmp/site, then benchmarks/gpu_check.py: every case in a process of its
# own with its own time limit, its rows printed and written to $OUT as soon as it ends (a failing case
# loses only its own rows). Commit the tables to benchmarks/results/ with the date.
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export QLORA_KIT_CACHE=/tmp/qlora-kit-cache HF_DATASETS_CACHE=/tmp/hf-datasets HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 benchmarks/gpu_check.py --out "${OUT:-gpu-check-out}" "$@" 2>&1 | grep -v -e "it/s\]" -e "examples/s\]" -e "^Loading weights" -e "^Writing model"
