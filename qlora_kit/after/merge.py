"""Merge a trained adapter into its base and export a standalone model, then check the drift.

The adapter was trained against the *dequantized 4-bit* weights, so by default the merge goes into
those (``base="dequantized"``: transformers' ``dequantize()`` turns every ``Linear4bit`` back into a
16-bit ``nn.Linear``); ``base="original"`` merges into the original 16-bit checkpoint instead. peft's
``merge_and_unload`` on a model still in 4-bit would re-quantize W + BA and lose most of the update.

The drift check compares, on held-out prompts (the recipe's validation rows, prompt and answer), the
next-token distributions of the model as trained (4-bit base + adapter, computed in float32 so that the
reference's own bf16 rounding is not counted against the merge) with the merged model loaded back from
disk by plain ``AutoModelForCausalLM.from_pretrained``: mean KL(trained || merged) over every
position, and how often their top-1 tokens agree. Past the thresholds the export is refused and left
in a temporary folder beside the destination, unless forced. The adapter folder is only read.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig

from qlora_kit.after import drift_bounds, routing_ties
from qlora_kit.after.floor import (
    MERGED_DTYPES,
    adapter_state,
    free_memory,
    load_trained_exactly,
    merged_model,
)
from qlora_kit.after.parity import decided_positions, training_ids
from qlora_kit.data import images, prepare, prompt_examples
from qlora_kit.data.images import ImageCollator
from qlora_kit.errors import MergeDriftError, OutputDirError, RecipeError
from qlora_kit.model import adapters, vision
from qlora_kit.model import loading as model
from qlora_kit.model.paths import check_model_folder, check_output_folder
from qlora_kit.registries.formats import IGNORE_INDEX

if TYPE_CHECKING:
    from collections.abc import Callable

    from qlora_kit.recipe.recipe import Recipe

# The merged folder's dtype: merged in fp32, rounded once into float16 (3 more mantissa bits than bf16,
# which is coarse against an update that is a small fraction of W; vLLM's "auto" serves f16 as f16).
# bfloat16 for a family whose activations overflow f16 (Gemma), float32 for the merge as computed.
MERGED_DTYPE = "float16"
# Judged against the trained model computed in float32 (floor.load_trained_exactly): the merged folder's
# weights as saved, read back into float32, so that the merge is judged by what it wrote and not by this
# machine's 16-bit kernels (the tiny Qwen3.5 mixture's float16 forward on the CPU moved its answers by
# 0.00059 nats while its float16 weights computed in float32 moved them by 1.4e-7: drift_bounds.py). The
# bounds are derived per merge from what it measures (drift_bounds.py): the merged weights' dtype (the
# experts' too), the layers the rounding passes through, and how spread the trained model's own
# distributions are; a wrong merge (an update scaled, a layer's or an expert's wrong) lies far past them.
# Top-1 counts only where the trained model's choice leads its runner-up by DECIDED nats (parity.py):
# rounding moves logits by hundredths there, so a flip is an error, while near-ties flip under any rounding.
MIN_TOP1 = 0.98
DRIFT_PROMPTS = 16


@dataclass
class Drift:
    mean_kl: float  # KL(trained || merged) per answer position
    top1_agreement: float  # at the answer positions the trained model has decided (DECIDED)
    positions: int  # answer positions
    decided: int = 0
    all_kl: float = 0.0  # every position, prompts included
    routing_ties: int = 0  # a mixture's positions left out: routing flipped at a near-tie (routing_ties.py)
    all_top1: float = 1.0  # every position: shown, not judged (near-ties flip under any rounding)
    max_kl: float = 0.0  # the bound derived for the answers' mean KL (drift_bounds.py)
    max_all_kl: float = 0.0  # and for every position's

    def within(self, max_kl: float, min_top1: float, max_all_kl: float | None = None) -> bool:
        """``max_all_kl`` None: every position's KL bound is ``max_kl`` too."""
        max_all_kl = max_kl if max_all_kl is None else max_all_kl
        return self.mean_kl <= max_kl and self.all_kl <= max_all_kl and self.top1_agreement >= min_top1


@dataclass
class MergeResult:
    output_dir: Path
    drift: Drift
    base: str


def merge_adapter(
    adapter_dir: str | Path,
    out_dir: str | Path,
    base: str = "dequantized",
    max_kl: float | None = None,
    min_top1: float = MIN_TOP1,
    force: bool = False,
    dtype: str = MERGED_DTYPE,
) -> MergeResult:
    """Write a standalone merged model to ``out_dir``; raise MergeDriftError when it drifts (unless forced).
    ``max_kl`` None: the bounds derived for this merge (``Drift.max_kl``, ``Drift.max_all_kl``); given, it
    bounds the KL at the answers and at every position alike."""
    adapter_dir, out_dir = Path(adapter_dir).resolve(), Path(out_dir).expanduser().resolve()
    check_output_folder(out_dir, "--out", reading=adapter_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise OutputDirError(f"--out: {out_dir} already holds files; choose an empty or new folder")
    if dtype not in MERGED_DTYPES:
        raise RecipeError(f"--dtype: must be one of {', '.join(MERGED_DTYPES)} (got {dtype!r})")
    recipe = adapters.recipe_of(adapter_dir)
    check_model_folder(model.resolve_model_path(recipe.model))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.merging-", dir=out_dir.parent))
    try:
        write_merged(recipe, adapter_dir, staging, base, dtype)
        drift = measure_drift(recipe, adapter_dir, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # nothing half-made is left beside the destination
        raise
    max_kl, max_all_kl = (drift.max_kl, drift.max_all_kl) if max_kl is None else (max_kl, max_kl)
    if not drift.within(max_kl, min_top1, max_all_kl) and not force:
        raise MergeDriftError(
            f"merged model drifts from the adapter: mean KL {drift.mean_kl:.4g} at the answers (max {max_kl:.4g}) "
            f"and {drift.all_kl:.4g} at every position (max {max_all_kl:.4g}), top-1 agreement "
            f"{drift.top1_agreement:.1%} where the adapter is decided (min {min_top1:.0%}); left in {staging}; "
            "--force exports it anyway"
        )
    if out_dir.exists():
        out_dir.rmdir()  # empty, checked above
    os.replace(staging, out_dir)
    return MergeResult(out_dir, drift, base)


def write_merged(
    recipe: Recipe,
    adapter_dir: Path | None,
    folder: Path,
    base: str,
    dtype: str = MERGED_DTYPE,
    four_bit_seen: Callable | None = None,
) -> None:
    """The adapter merged into the ``base`` weights in fp32 (or, with ``adapter_dir`` None, the base
    alone) and rounded once into ``dtype``, saved with its tokenizer (chat template included) and
    generation config; export builds on it (a GGUF from the fp32 folder: rounded once, into its type).
    ``four_bit_seen``: floor.merged_model's."""
    merged = merged_model(recipe, adapter_dir, base, four_bit_seen).to(getattr(torch, dtype))
    save_merged(recipe, adapter_dir, merged, folder)


def save_merged(recipe: Recipe, adapter_dir: Path | None, merged, folder: Path) -> None:
    """``merged`` (floor.merged_model's) saved as a plain checkpoint with its tokenizer, and left as it
    was: export rounds the same fp32 model into its type for the floor once it is saved."""
    with _as_plain_checkpoint(merged, recipe.model.trust_remote_code):
        merged.save_pretrained(folder)
    tokenizer = model.load_tokenizer(recipe.model, path=str(adapter_dir) if adapter_dir else None)
    tokenizer.save_pretrained(folder)
    found = model.load_processor(recipe.model)  # a vision-language model: its processor beside it
    if found is not None:
        found[0].save_pretrained(folder)


@contextlib.contextmanager
def _as_plain_checkpoint(lm, trust_remote_code: bool):
    """``lm`` as a plain checkpoint while it is saved (GPT-2's Conv1D layers back, no quantization config
    left behind, the KV cache on for inference), and afterwards as it was: the layers and settings the
    floor computes with."""
    swapped = _restore_conv1d(lm, trust_remote_code)
    configs = list({id(c): c for c in (lm.config, lm.config.get_text_config())}.values())
    use_cache = [c.use_cache for c in configs]
    kept = {
        (owner, name): getattr(owner, name)
        for owner, name in ((lm.config, "quantization_config"), (lm, "hf_quantizer"))
        if hasattr(owner, name)
    }
    for owner, name in kept:
        delattr(owner, name)
    lm.hf_quantizer = None
    for config in configs:
        config.use_cache = True
    try:
        yield
    finally:
        for config, value in zip(configs, use_cache, strict=True):
            config.use_cache = value
        del lm.hf_quantizer
        for (owner, name), value in kept.items():
            setattr(owner, name, value)
        for parent, child, linear in swapped:
            setattr(parent, child, linear)


def _restore_conv1d(lm, trust_remote_code: bool) -> list[tuple]:
    """GPT-2's projections are transformers ``Conv1D`` layers, weights stored (in, out); loading in 4-bit
    made them ``Linear4bit`` and ``dequantize()`` plain ``nn.Linear`` (out, in). Saved so, the checkpoint
    no longer loads (a (3h, h) c_attn where (h, 3h) is expected), or a square one loads transposed.
    Returns (parent, name, the nn.Linear replaced) for each, to put back after the save."""
    from transformers.pytorch_utils import Conv1D

    swapped = []
    with torch.device("meta"):
        skeleton = vision.auto_class(lm.config).from_config(lm.config, trust_remote_code=trust_remote_code)
    for name, module in skeleton.named_modules():
        current = lm.get_submodule(name) if name else lm
        if not isinstance(module, Conv1D) or not isinstance(current, torch.nn.Linear):
            continue
        restored = Conv1D(current.out_features, current.in_features).to(current.weight.dtype)
        with torch.no_grad():
            restored.weight.copy_(current.weight.T)
            if current.bias is not None:
                restored.bias.copy_(current.bias)
            else:
                restored.bias.zero_()
        parent, _, child = name.rpartition(".")
        swapped.append((lm.get_submodule(parent), child, current))
        setattr(lm.get_submodule(parent), child, restored)
    return swapped


def measure_drift(recipe: Recipe, adapter_dir: Path, merged_dir: Path, prompts: int = DRIFT_PROMPTS) -> Drift:
    """KL and top-1 agreement between 4-bit base + adapter (computed in float32) and the merged model on
    held-out rows, at their answers' positions (and at every position, shown).

    One model on the device at a time (a 16-bit 8B model and its 4-bit twin would not both fit a 24 GB
    GPU): the trained model's log-probabilities are kept on the host, then the merged model is loaded
    onto the same device and compared with them. Every input goes to the device of its model.
    """

    batches, answers, references, routing = _trained_figures(recipe, adapter_dir, prompts)
    # its weights as saved, computed in float32: the merge is judged by what it wrote (module comment)
    config = AutoConfig.from_pretrained(merged_dir)
    merged = vision.auto_class(config).from_pretrained(
        merged_dir, dtype=torch.float32, device_map=model.device_map()
    )
    choices = routing_ties.RouterChoices(merged)
    candidates = _log_probs(merged, batches)
    choices.remove()
    kl, same, answer, decided, expected, judged = [], [], [], [], [], []
    roundoff, passes = drift_bounds.weight_roundoff(merged_dir), drift_bounds.rounding_passes(config)
    merged_routing = choices.rows()
    # the same routers read on both sides, else no position is left out
    compared = (
        bool(routing) and len(merged_routing) == len(routing) and len(routing[0]) == len(choices.layers)
    )
    for row, (reference, candidate, mask) in enumerate(zip(references, candidates, answers, strict=True)):
        # a mixture's positions whose routing flipped at a near-tie are left out of the means (routing_ties.py)
        tie = (
            routing_ties.near_tie_flips(routing[row], merged_routing[row], choices.layers, roundoff)
            if compared
            else torch.zeros(reference.shape[0], dtype=torch.bool)
        )
        judged.append(~tie[:-1])
        # position t predicts token t + 1: the last position predicts past the row
        reference, candidate = reference[:-1].double(), candidate[:-1].double()
        kl.append(torch.nn.functional.kl_div(candidate, reference, log_target=True, reduction="none").sum(-1))
        same.append(reference.argmax(-1) == candidate.argmax(-1))
        answer.append(mask)
        decided.append(mask & decided_positions(reference))  # log-probabilities: the same margins
        expected.append(drift_bounds.expected_kl(reference, roundoff, passes))
    kl, same, answer, decided, expected, judged = (
        torch.cat(x) for x in (kl, same, answer, decided, expected, judged)
    )
    positions = int(answer.sum())
    if not positions:
        answer = torch.ones_like(answer)  # no answer position: every position's figures
    answer, decided = answer & judged, decided & judged
    return Drift(
        mean_kl=float(kl[answer].mean()) if answer.any() else 0.0,
        top1_agreement=float(same[decided].float().mean()) if decided.any() else 1.0,
        positions=positions,
        decided=int(decided.sum()),
        all_kl=float(kl[judged].mean()),
        all_top1=float(same.float().mean()),
        max_kl=drift_bounds.bound(expected[answer]) if answer.any() else 0.0,
        max_all_kl=drift_bounds.bound(expected[judged]),
        routing_ties=int((~judged).sum()),
    )


# The last adapter state's held-out inputs and log-probabilities (as parity keeps its reference): two drift
# checks against one adapter in one process (a notebook, the suite) load and run the trained model once.
_LAST_TRAINED: dict[tuple, tuple] = {}


def _trained_figures(recipe: Recipe, adapter_dir: Path, prompts: int) -> tuple[list, list, list, list]:
    """(inputs, answer masks, log-probabilities, a mixture's routing per row: RouterChoices.rows) of the
    trained model on the held-out rows."""
    key = (*adapter_state(adapter_dir), prompts, recipe.to_yaml())
    if key not in _LAST_TRAINED:
        _LAST_TRAINED.clear()
        _, tokenizer, trained = load_trained_exactly(adapter_dir, recipe)
        batches, answers = _held_out_inputs(recipe, tokenizer, prompts)
        choices = routing_ties.RouterChoices(trained)
        log_probs = _log_probs(trained, batches)
        choices.remove()
        _LAST_TRAINED[key] = (batches, answers, log_probs, choices.rows())
        del trained
        free_memory()
    return _LAST_TRAINED[key]


def _log_probs(lm, batches: list[dict]) -> list:
    """Next-token log-probabilities (T, V) of each one-row batch of inputs, in fp32 on the host."""
    lm.eval()
    with torch.no_grad():
        return [
            torch.log_softmax(
                lm(**{k: v.to(lm.device) for k, v in inputs.items()}).logits.float()[0], dim=-1
            ).cpu()
            for inputs in batches
        ]


def _held_out_inputs(recipe: Recipe, tokenizer, count: int) -> tuple[list[dict], list[torch.Tensor]]:
    """The first ``count`` validation rows, prompt and answer, as one-row model inputs (a vision-language
    model's with their images' pixels, as training fed them: data/images.py), and for each, which of its
    positions predict an answer token ((T - 1,) booleans)."""

    runs = images.image_runs(recipe.model)
    if runs is not None:
        prepared = prepare.prepare_datasets(
            images.one_example_a_row(recipe.data), tokenizer, recipe.train.seed, runs=runs
        )
        if prepared.val is None:
            raise RecipeError("merge: the drift check needs validation data in the adapter's recipe")
        collator = ImageCollator(prepare.build_collator(tokenizer, packing=False), runs)
        rows = [collator([row]) for row in prepared.val.select(range(min(count, len(prepared.val))))]
        answers = [row["labels"][0, 1:] != IGNORE_INDEX for row in rows]
        return [{k: v for k, v in row.items() if k != "labels"} for row in rows], answers
    prepared = prepare.prepare_datasets(recipe.data, tokenizer, recipe.train.seed)
    examples = prompt_examples.prompt_examples(prepared, recipe.data, tokenizer, count)
    if not examples:
        raise RecipeError("merge: the drift check needs validation data in the adapter's recipe")
    inputs, answers = [], []
    for example in examples:  # as the parity report asks them (parity.training_ids)
        prompt = training_ids(tokenizer, example.prompt)
        reply = tokenizer(example.reference, add_special_tokens=False)["input_ids"]
        inputs.append({"input_ids": torch.tensor([prompt + reply])})
        answers.append(torch.arange(len(prompt) + len(reply) - 1) >= len(prompt) - 1)
    return inputs, answers
