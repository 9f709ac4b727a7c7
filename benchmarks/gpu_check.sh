#!/usr/bin/env bash
# The GPU check for a session lent the H200 (one call of the device tool, under 10 minutes):
#   bash benchmarks/fetch_gpu_wheels.sh                                # here, once: wheels into .whl/
#   device run: command "bash benchmarks/gpu_check.sh", carry [".whl"], timeout_s 595
# Installs the carried wheels into /tmp/site, runs `qlora-kit doctor`, then benchmarks/gpu_check.py
# (every figure through trainer.train()); its table is printed last and its JSON lands in $OUT.
# Commit the tables to benchmarks/results/gpu-h200.md with the date. The timeouts add up to 10 minutes;
# a healthy run takes about half of that.
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export QLORA_KIT_CACHE=/tmp/qlora-kit-cache HF_DATASETS_CACHE=/tmp/hf-datasets
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# First what every user runs first: versions, device, a real tiny run through `qlora-kit train`'s path
# (bf16 autocast, paged 8-bit AdamW, chunked head), reload with plain peft, merge + drift check.
timeout 60 python3 -m qlora_kit doctor recipes/demo.yaml 2>&1 | tee "${OUT:-/tmp}/doctor.log" | grep -v -e "it/s\]" -e "examples/s\]" | tail -30
# FSDP-QLoRA on one GPU: train, kill after step 4, resume; against one plain process (benchmarks/fsdp_check.py).
timeout 130 python3 benchmarks/fsdp_check.py --processes 1 2>&1 | grep -A8 "^| run"
cp benchmarks/results/fsdp-gpu.md "${OUT:-/tmp}/" 2>/dev/null
# Packing without cross-attention on every kernel the machine has (flash ones where installed).
timeout 60 python3 benchmarks/packing_check.py 2>&1 | grep "^packing"
# DPO (train.objective dpo, TRL's DPOTrainer with the frozen "ref" adapter) on the demo pairs, then its evaluation.
timeout 45 python3 -m qlora_kit train recipes/demo-dpo.yaml --output-dir /tmp/demo-dpo -q 2>&1 | grep -E "preference|eval loss,|error"
timeout 30 python3 -m qlora_kit eval --adapter /tmp/demo-dpo 2>&1 | grep -E "accuracy|margin|error"
# Its last case, a real out-of-memory error split in the step, adds two short runs, and the checkpointing
# frontier (selective; auto half-way, its costs timed here, beside the every_n fitting it) three: the time
# of vs_trl, which printed nothing within 90 s on 2026-11-30 and needs a call of its own
# (python3 benchmarks/vs_trl.py --rounds 2 --steps 16; writes results/vs-trl-gpu.md).
timeout 275 python3 benchmarks/gpu_check.py "$@" 2>&1 | tee "${OUT:-/tmp}/gpu-check.log" | grep -v -e "it/s\]" -e "examples/s\]"
