"""The merge in fp32, the floor an export's type sets, and the 4-bit base's difference from its checkpoint.

The adapter was trained against the dequantized 4-bit weights W (exact in the compute dtype), so the
trained model's effective weight is W + (alpha / r) * B @ A. ``merged_model`` computes it in fp32 and
rounds nothing: each export then rounds it once, into its own type (a merged folder's dtype, a GGUF's
f16, bf16 or q8_0). Rounding the sum into bf16 first and then writing a GGUF from that folder rounded
twice, and bf16's 8-bit mantissa is coarse against an update that is a small fraction of W (measured in
benchmarks/results/export-precision-real-cpu.md).

``round_into`` makes that rounding in memory, as the writers store it, so the report can measure what
a correct export of that type must lose (its floor) and judge the export against it, not against a
fixed number set on another model.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qlora_kit.model import adapters, moe_experts, vision
from qlora_kit.model import loading as model

if TYPE_CHECKING:
    from collections.abc import Callable

MERGED_DTYPES = ("float16", "bfloat16", "float32")
GGUF_TYPES = ("f16", "bf16", "q8_0")


def load_trained_exactly(adapter_dir: Path, recipe):
    """(recipe, tokenizer, model): the trained model as merge's drift check and the parity report take
    their reference, the 4-bit base and the adapter as trained, computed in float32. A bf16 forward's own
    rounding (the default compute dtype) parts it from the same weights computed exactly: on the real
    model it was nine tenths of a correct merge's measured KL and flipped top-1 at near-ties, where a
    wrong merge (the update x 0.9, one layer's dropped) is many times farther in float32
    (benchmarks/results/export-calibration-real-cpu.md). Not sharded: one process reads it."""
    exact = recipe.with_overrides({"quant.compute_dtype": "float32", "train.fsdp": False})
    return adapters.load_trained(adapter_dir, exact)


def merged_model(recipe, adapter_dir: Path | None, base: str, four_bit_seen: Callable | None = None):
    """The adapter merged into the ``base`` weights in fp32 (with ``adapter_dir`` None, the base alone):
    ``dequantized`` the 4-bit base dequantized (what the adapter trained against), ``original`` the
    checkpoint the 4-bit base came from. peft's merge on a model still in 4-bit would re-quantize
    W + BA and lose most of the update, so the base is dequantized first. ``four_bit_seen(model)`` reads
    the 4-bit base before it is dequantized (export's base_difference: one load, not two)."""
    from transformers import AutoConfig

    if base == "dequantized":
        # dequantize() gives the compute dtype, which holds NF4's values exactly; fp32 then loses nothing
        four_bit = model.load_base_model(recipe.model, recipe.quant)
        if four_bit_seen is not None:
            four_bit_seen(four_bit)
        moe_experts.dequantize_experts(four_bit)  # a mixture's packed experts, which dequantize() skips
        sixteen_bit = four_bit.dequantize()
    elif base == "original":
        path = model.resolve_model_path(recipe.model)
        sixteen_bit = vision.auto_class(AutoConfig.from_pretrained(path)).from_pretrained(
            path,
            dtype=torch.float32,
            trust_remote_code=recipe.model.trust_remote_code,
            revision=recipe.model.revision,
        )
    else:
        raise ValueError(f"--base: must be dequantized or original (got {base!r})")
    merged = sixteen_bit.float()
    if adapter_dir is not None:
        merged = adapters.load_adapter(merged, adapter_dir).merge_and_unload()
    return merged.float().eval()


def round_into(lm, kind: str):
    """``lm``'s weights rounded in place as an export of ``kind`` stores them: a merged dtype rounds
    every tensor; a GGUF type rounds each matrix (norms, biases and a mixture's router stay F32, as the
    writer keeps them; a q8_0 matrix whose rows do not tile 32-value blocks is F16, the writer's
    fallback)."""
    _, experts = moe_experts.experts_of(lm)
    router = f"{experts.router}.weight" if experts and experts.router and kind in GGUF_TYPES else None
    with torch.no_grad():
        for name, parameter in lm.named_parameters():  # a tied head is one parameter: rounded once
            if router is None or not name.endswith(router):
                parameter.copy_(rounded(parameter.data, kind))
    return lm


def rounded(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """One tensor as an export of ``kind`` stores it, back in fp32."""
    if kind in MERGED_DTYPES:
        return tensor.to(getattr(torch, kind)).float()
    if tensor.ndim < 2:
        return tensor.float()
    if kind in ("f16", "bf16"):
        return tensor.to(torch.float16 if kind == "f16" else torch.bfloat16).float()
    if kind == "q8_0":
        if tensor.shape[-1] % 32:
            return tensor.to(torch.float16).float()
        import gguf

        data = tensor.float().cpu().numpy()
        qtype = gguf.GGMLQuantizationType.Q8_0
        back = gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype)
        return torch.from_numpy(back.reshape(data.shape)).to(tensor.device)
    raise ValueError(f"unknown export type {kind!r}")


def base_difference(recipe) -> dict | None:
    """How far the dequantized 4-bit weights are from the 16-bit checkpoint they came from (what
    ``onto=original`` adds to the merge): per quantized layer ||W_original - W_dequantized|| / ||W_original||."""
    if not any(Path(model.resolve_model_path(recipe.model)).glob("*.safetensors")):
        return None  # a hub id or a checkpoint without safetensors: no original to compare
    quantized = model.load_base_model(recipe.model, recipe.quant)
    measured = base_difference_of(recipe, quantized)
    del quantized
    free_memory()
    return measured


def adapter_state(adapter_dir: Path) -> tuple:
    """The adapter folder as it stands (each file's name, modification time and size): a figure cached for
    one state is computed again once the folder is written to (parity's reference, merge's drift)."""
    files = (p for p in adapter_dir.iterdir() if p.is_file())
    return (str(adapter_dir), tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files)))


def free_memory() -> None:
    """What a model let go of returned: Python's cycles collected, CUDA's cached blocks handed back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def base_difference_of(recipe, quantized) -> dict | None:
    """base_difference's figures from ``quantized``, the recipe's 4-bit base as loaded."""
    from bitsandbytes.functional import dequantize_4bit
    from safetensors import safe_open

    folder = Path(model.resolve_model_path(recipe.model))
    where = {}
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(shard, "pt") as tensors:
            where.update(dict.fromkeys(tensors.keys(), shard))
    if not where:
        return None  # a hub id or a checkpoint without safetensors: no original to compare
    relative, largest = [], 0.0
    for name, module in quantized.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or weight.__class__.__name__ != "Params4bit" or f"{name}.weight" not in where:
            continue
        with safe_open(where[f"{name}.weight"], "pt") as tensors:
            original = tensors.get_tensor(f"{name}.weight").float()
        dequantized = dequantize_4bit(weight.data, weight.quant_state).float().cpu()
        if original.shape != dequantized.shape:  # GPT-2's Conv1D: (in, out) on disk, (out, in) in 4-bit
            original = original.T
        difference = original - dequantized
        relative.append(float(difference.norm() / original.norm()))
        largest = max(largest, float(difference.abs().max()))
    if not relative:
        return None
    return {
        "layers": len(relative),
        "mean_relative": sum(relative) / len(relative),
        "max_abs": largest,
        "note": "the 4-bit base's rounding: onto=original adds it to the merge, onto=dequantized does not",
    }
