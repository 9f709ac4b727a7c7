# qlora_kit, reproducibly: every Python package comes from a locked, hashed requirements file.
#
#   docker build -t qlora-kit .
#   docker run --gpus all -v "$PWD/outputs:/outputs" -v "$HOME/.cache/huggingface:/data/hf" \
#     qlora-kit train recipes/llama3-8b-alpaca-24gb.yaml --output-dir /outputs/llama3
#
# torch's CUDA wheels bring their own CUDA libraries, so a plain Python base image is enough for GPUs.
# The lock's torch is PyPI's, a CUDA 13.0 build: it needs an NVIDIA driver >= 580. For a CUDA 12 driver
# (>= 525.60.13), take the lock's torch version from PyTorch's own index for a CUDA 12 build instead:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 -t qlora-kit:cu126 .
# CI builds the CPU variant from a local Debian base: --build-arg BASE_IMAGE=... LOCK_FILE=docker/requirements-cpu.lock
# PIP_FIND_LINKS=<folder holding the CPU torch wheel> (see scripts/build_image.sh).
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG LOCK_FILE=docker/requirements.lock
ARG PIP_FIND_LINKS=
ARG TORCH_INDEX_URL=
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/data/hf \
    QLORA_KIT_CACHE=/data/qlora-kit \
    HF_DATASETS_CACHE=/data/hf/datasets

# A virtual environment: Debian's own Python refuses pip installs into the system (PEP 668).
RUN python3 -m venv /opt/venv

# Exactly the locked versions, each checked against its hash; nothing resolved here. With
# TORCH_INDEX_URL: the lock without torch and its CUDA packages (each entry from its name line to the
# next), then the lock's torch version and its CUDA packages from that index (resolved there, unhashed).
COPY ${LOCK_FILE} /tmp/requirements.lock
RUN if [ -z "$TORCH_INDEX_URL" ]; then \
        pip install --require-hashes --no-deps -r /tmp/requirements.lock ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"}; \
    else \
        awk '/^[a-z0-9]/ { skip = /^(torch==|triton==|nvidia-|cuda-)/ } !skip' /tmp/requirements.lock > /tmp/without-torch.lock \
        && pip install --require-hashes --no-deps -r /tmp/without-torch.lock ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} \
        && pip install "$(grep -o '^torch==[^ ;]*' /tmp/requirements.lock)" --index-url "$TORCH_INDEX_URL"; \
    fi \
    && rm -f /tmp/requirements.lock /tmp/without-torch.lock

# The project on top, without dependency resolution, built with the locked setuptools.
COPY pyproject.toml README.md /src/
COPY qlora_kit /src/qlora_kit
# qlora_kit/recipes is a symlink to ../recipes: the wheel ships the recipes from there
COPY recipes /src/recipes
RUN pip install --no-deps --no-build-isolation /src && rm -rf /src
COPY recipes /app/recipes

RUN useradd --create-home --uid 1000 qlora && mkdir -p /data /outputs && chown qlora /data /outputs
USER qlora
WORKDIR /app
VOLUME ["/data", "/outputs"]
ENTRYPOINT ["qlora-kit"]
CMD ["--help"]
