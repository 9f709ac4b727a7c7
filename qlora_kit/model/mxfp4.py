"""Model stage: a checkpoint stored in MXFP4 (the released gpt-oss) dequantized once into a 16-bit folder in
the cache, which the ordinary loading then reads: its linear layers into bitsandbytes' 4 bits, its experts
packed in NF4 by moe_experts, as any 16-bit checkpoint's.

transformers refuses a BitsAndBytesConfig for a checkpoint whose config names another quantization method
(quantizers/auto.py, merge_quantization_configs), and its MXFP4 kernels need triton and train nothing
(quantizer_mxfp4.py). ``Mxfp4Config(dequantize=True)`` is transformers' own dequantization
(integrations/mxfp4.py, ``convert_moe_packed_tensors``: FP4 values in blocks of 32 sharing a power-of-two
scale), done here once per checkpoint: a second run finds the folder and loads it directly.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Mxfp4Config

from qlora_kit.model import builtin

log = logging.getLogger(__name__)

MXFP4_BITS = 4 + 8 / 32  # a 4-bit value, and one 8-bit scale per block of 32
BUILD_VERSION = 1  # bump when the dequantized folder's contents change


def is_mxfp4(config) -> bool:
    """Whether ``config`` (a checkpoint's) says its weights are stored in MXFP4."""
    quantization = getattr(config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
    return str(method).lower() == "mxfp4"


def dequantized_folder(path: str, revision: str | None, trust_remote_code: bool) -> str:
    """The 16-bit copy of the MXFP4 checkpoint at ``path`` (at the hub's ``revision``), made on the first call
    and found in the cache afterwards."""
    key = hashlib.sha256(json.dumps([BUILD_VERSION, path, revision]).encode()).hexdigest()[:12]
    folder = builtin.cache_root() / "dequantized" / f"{Path(path).name}-{key}"
    if (folder / "config.json").exists():
        log.info("MXFP4 checkpoint %s: its dequantized copy %s", path, folder)
        return str(folder)
    return str(
        builtin.build_into(
            folder, lambda staging: _dequantize(path, revision, trust_remote_code, staging, folder)
        )
    )


def _dequantize(
    path: str, revision: str | None, trust_remote_code: bool, staging: Path, folder: Path
) -> None:
    lm = AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=Mxfp4Config(dequantize=True),
        dtype=torch.bfloat16,
        device_map={"": "cpu"},  # the whole 16-bit model passes through host memory once
        trust_remote_code=trust_remote_code,
        revision=revision,
    )
    experts = sum(
        p.numel()
        for n, p in lm.named_parameters()
        if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    )
    # a plain 16-bit checkpoint: nothing left saying MXFP4 (transformers drops it once dequantized; merge too)
    if hasattr(lm.config, "quantization_config"):
        del lm.config.quantization_config
    lm.hf_quantizer = None
    builtin.save_into_staging(lm, staging)
    AutoTokenizer.from_pretrained(
        path, trust_remote_code=trust_remote_code, revision=revision
    ).save_pretrained(staging)
    log.info(
        "MXFP4 checkpoint %s dequantized once (transformers' Mxfp4Config(dequantize=True)): experts %s MiB in "
        "MXFP4, %s MiB in bf16 in %s; the load packs them in 4 bits",
        path,
        f"{experts * MXFP4_BITS / 8 / 2**20:,.1f}",
        f"{experts * 2 / 2**20:,.1f}",
        folder,
    )
