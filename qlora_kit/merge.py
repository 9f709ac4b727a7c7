"""Merge a trained adapter into its base and export a standalone model, then check the drift.

The adapter was trained against the *dequantized 4-bit* weights, so by default the merge goes into
those (``base="dequantized"``: transformers' ``dequantize()`` turns every ``Linear4bit`` back into a
16-bit ``nn.Linear``); ``base="original"`` merges into the original 16-bit checkpoint instead. peft's
``merge_and_unload`` on a model still in 4-bit would re-quantize W + BA and lose most of the update.

The drift check compares, on held-out prompts (the recipe's validation rows, prompt and answer), the
next-token distributions of the model as trained (4-bit base + adapter) with the merged model loaded
back from disk by plain ``AutoModelForCausalLM.from_pretrained``: mean KL(trained || merged) over every
position, and how often their top-1 tokens agree. Past the thresholds the export is refused and left
in a temporary folder beside the destination, unless forced. The adapter folder is only read.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from qlora_kit import adapters, data, model

if TYPE_CHECKING:
    from qlora_kit.recipe import Recipe

MAX_KL = 0.02
MIN_TOP1 = 0.98
DRIFT_PROMPTS = 16


class MergeDriftError(RuntimeError):
    """The merged model drifts from the adapter it came from; the export was left in a staging folder."""


@dataclass
class Drift:
    mean_kl: float
    top1_agreement: float
    positions: int

    def within(self, max_kl: float, min_top1: float) -> bool:
        return self.mean_kl <= max_kl and self.top1_agreement >= min_top1


@dataclass
class MergeResult:
    output_dir: Path
    drift: Drift
    base: str


def merge_adapter(
    adapter_dir: str | Path,
    out_dir: str | Path,
    base: str = "dequantized",
    max_kl: float = MAX_KL,
    min_top1: float = MIN_TOP1,
    force: bool = False,
) -> MergeResult:
    """Write a standalone merged model to ``out_dir``; raise MergeDriftError when it drifts (unless forced)."""
    from qlora_kit.outputs import OutputDirError

    adapter_dir, out_dir = Path(adapter_dir).resolve(), Path(out_dir).expanduser().resolve()
    if out_dir.exists() and any(out_dir.iterdir()):
        raise OutputDirError(f"--out: {out_dir} already holds files; choose an empty or new folder")
    if out_dir == adapter_dir or adapter_dir in out_dir.parents:
        raise OutputDirError("--out: must be outside the adapter folder (merging never writes into it)")
    recipe = adapters.recipe_of(adapter_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.merging-", dir=out_dir.parent))
    _export(recipe, adapter_dir, staging, base)
    drift = measure_drift(recipe, adapter_dir, staging)
    if not drift.within(max_kl, min_top1) and not force:
        raise MergeDriftError(
            f"merged model drifts from the adapter: mean KL {drift.mean_kl:.4g} (max {max_kl}), top-1 agreement "
            f"{drift.top1_agreement:.1%} (min {min_top1:.0%}); left in {staging}; --force exports it anyway"
        )
    if out_dir.exists():
        out_dir.rmdir()  # empty, checked above
    os.replace(staging, out_dir)
    return MergeResult(out_dir, drift, base)


def _export(recipe: Recipe, adapter_dir: Path, folder: Path, base: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    if base == "dequantized":
        quantized = model.load_base_model(recipe.model, recipe.quant)
        sixteen_bit = quantized.dequantize()
    elif base == "original":
        sixteen_bit = AutoModelForCausalLM.from_pretrained(
            model.resolve_model_path(recipe.model),
            dtype=getattr(torch, recipe.quant.compute_dtype),
            trust_remote_code=recipe.model.trust_remote_code,
            revision=recipe.model.revision,
        )
    else:
        raise ValueError(f"--base: must be dequantized or original (got {base!r})")
    merged = adapters.load_adapter(sixteen_bit, adapter_dir).merge_and_unload()
    # A plain checkpoint: no quantization config left behind, the KV cache back on for inference.
    if hasattr(merged.config, "quantization_config"):
        del merged.config.quantization_config
    merged.hf_quantizer = None
    merged.config.use_cache = True
    merged.save_pretrained(folder)
    tokenizer = model.load_tokenizer(recipe.model, path=str(adapter_dir))
    tokenizer.save_pretrained(folder)


def measure_drift(recipe: Recipe, adapter_dir: Path, merged_dir: Path, prompts: int = DRIFT_PROMPTS) -> Drift:
    """KL and top-1 agreement between 4-bit base + adapter and the merged model on held-out text."""
    import torch
    from transformers import AutoModelForCausalLM

    _, tokenizer, trained = adapters.load_trained(adapter_dir, recipe)
    merged = AutoModelForCausalLM.from_pretrained(
        merged_dir, dtype=getattr(torch, recipe.quant.compute_dtype)
    )
    texts = _held_out_texts(recipe, tokenizer, prompts)
    kl_sum, agree, positions = 0.0, 0, 0
    trained.eval()
    merged.eval()
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            reference = torch.log_softmax(trained(input_ids=ids).logits.float()[0], dim=-1)  # (T, V)
            candidate = torch.log_softmax(merged(input_ids=ids).logits.float()[0], dim=-1)
            kl = torch.nn.functional.kl_div(candidate, reference, log_target=True, reduction="none").sum(-1)
            kl_sum += float(kl.sum())
            agree += int((reference.argmax(-1) == candidate.argmax(-1)).sum())
            positions += ids.shape[1]
    return Drift(mean_kl=kl_sum / positions, top1_agreement=agree / positions, positions=positions)


def _held_out_texts(recipe: Recipe, tokenizer, count: int) -> list[str]:
    prepared = data.prepare_datasets(recipe.data, tokenizer, recipe.train.seed)
    examples = data.prompt_examples(prepared, recipe.data, tokenizer, count)
    if not examples:
        from qlora_kit.recipe import RecipeError

        raise RecipeError("merge: the drift check needs validation data in the adapter's recipe")
    return [ex.prompt + ex.reference for ex in examples]
