#!/usr/bin/env bash
# The GPU check for a session lent the H200 (one call of the device tool, under 8 minutes):
#   bash benchmarks/fetch_gpu_wheels.sh                                # here, once: wheels into .whl/
#   device run: command "bash benchmarks/gpu_check.sh", carry [".whl"], timeout_s 540
# Installs the carried wheels into /tmp/site, runs `qlora-kit doctor`, then benchmarks/gpu_check.py
# (every figure through trainer.train()); its table is printed last and its JSON lands in $OUT.
# Commit the tables to benchmarks/results/gpu-h200.md with the date. The timeouts add up to 8.5 minutes.
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
# FSDP-QLoRA wiring, one process (the shipped accelerate config; quant_storage = compute dtype).
timeout 60 python3 -m accelerate.commands.launch --config_file recipes/accelerate/fsdp-qlora.yaml --num_processes 1 \
  -m qlora_kit train recipes/demo.yaml --output-dir /tmp/fsdp-check --overwrite --set train.fsdp=true \
  --set quant.quant_storage=bfloat16 --set memory.chunked_loss=false --set train.max_steps=10 \
  --set train.sample_prompts=0 > "${OUT:-/tmp}/fsdp-check.log" 2>&1
echo "fsdp-qlora 1 process: exit $? ($(grep -o 'eval loss: .*' "${OUT:-/tmp}/fsdp-check.log" | tail -1))"
# Packing without cross-attention on every kernel the machine has (flash ones where installed).
timeout 60 python3 benchmarks/packing_check.py 2>&1 | grep "^packing"
timeout 240 python3 benchmarks/gpu_check.py "$@" 2>&1 | tee "${OUT:-/tmp}/gpu-check.log" | grep -v -e "it/s\]" -e "examples/s\]"
# qlora_kit against the TRL + PEFT script on the GPU (benchmarks/vs_trl.py; writes results/vs-trl-gpu.md).
timeout 90 python3 benchmarks/vs_trl.py --rounds 2 --steps 16 2>&1 | grep -A12 "^| comparison"
