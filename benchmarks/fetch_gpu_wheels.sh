#!/usr/bin/env bash
# Download, here, the wheels the lent GPU machine lacks (its image has torch, accelerate, typer, rich and
# pyyaml, but no bitsandbytes, datasets, pydantic or trl, and an older transformers), into .whl/ (ignored by git),
# for the device tool's `carry`. Python 3.12, x86-64, as that machine runs. About 20 MiB of the 64 allowed (bitsandbytes trimmed to the CUDA 13 library).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl \
  "bitsandbytes==0.50.2" "transformers==5.24.0" "peft==0.21.2" "datasets==5.2.0" "dill==0.4.0" "multiprocess==0.70.18" \
  "pydantic==2.14.4" "pydantic-core==2.50.5" "typing-inspection" "annotated-types" "trl==1.16.0"
# bitsandbytes ships a library for every CUDA, ROCm and XPU version (43 MiB); the H200's torch is CUDA 13:
# keep libbitsandbytes_cuda130.so and the CPU one (3.6 MiB), with their RECORD lines, so the carry fits.
python3 - <<'PY'
import glob, zipfile, os
(wheel,) = glob.glob(".whl/bitsandbytes-*.whl")
keep = lambda name: not name.endswith(".so") or name.endswith(("_cuda130.so", "_cpu.so"))
trimmed = wheel + ".tmp"
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(trimmed, "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if not keep(item.filename):
            continue
        data = src.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines()
            data = ("\n".join(line for line in lines if keep(line.split(",")[0])) + "\n").encode()
        dst.writestr(item, data)
os.replace(trimmed, wheel)
PY
# Our own package, without dependencies, so the check imports it as installed.
python3 -m pip wheel -q --no-deps -w .whl .
du -sh .whl && ls .whl
