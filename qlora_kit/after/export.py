"""``qlora-kit export``: a trained run as a merged 16-bit folder (transformers, vLLM) or one GGUF file
(llama.cpp, Ollama), checked by the parity report before it is handed over.

Both start from ``merge.write_merged``: the adapter merged into the weights it was trained against
(``onto="dequantized"``: the 4-bit base dequantized) or into the 16-bit checkpoint the 4-bit base came
from (``onto="original"``); the report gives the difference between the two bases either way. A GGUF is
then written from that folder (``gguf_writer``), with an Ollama ``Modelfile``; ``lora_only`` writes the
adapter as a LoRA GGUF beside a GGUF of the base it applies to. Everything is made in a staging folder
beside the destination and moved there only when every comparison of the report (``parity``) is within
its thresholds; otherwise ``ExportParityError`` names the figure and the staging folder is kept.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from qlora_kit.after import gguf_writer, modelfile, parity
from qlora_kit.after.merge import write_merged
from qlora_kit.errors import ExportError, ExportParityError, OutputDirError
from qlora_kit.model import adapters
from qlora_kit.model import loading as model
from qlora_kit.model.paths import check_model_folder, check_output_folder

TARGETS = ("merged", "gguf")
ONTO = ("dequantized", "original")
PROMPTS = 16
TOKENS = 16
REPORT = "export_report.json"


@dataclass(frozen=True)
class Threshold:
    max_abs_logit: float  # largest |Δ logit| on any answer token
    mean_abs_logit: float
    min_greedy_agreement: float


# Per comparison: a 16-bit export against the trained model carries the merge's own rounding (W + BA in
# the compute dtype); a GGUF against the merged model only its storage type's rounding.
THRESHOLDS = {
    ("merged", "trained"): Threshold(1.0, 0.1, 0.95),
    ("f16", "merged"): Threshold(0.25, 0.02, 0.95),
    ("bf16", "merged"): Threshold(1.0, 0.1, 0.95),
    ("q8_0", "merged"): Threshold(1.0, 0.1, 0.9),
    ("f16", "trained"): Threshold(1.0, 0.1, 0.95),
    ("bf16", "trained"): Threshold(1.5, 0.15, 0.95),
    ("q8_0", "trained"): Threshold(1.5, 0.15, 0.9),
}


@dataclass
class ExportResult:
    output_dir: Path
    report: dict


def export(
    adapter_dir: str | Path,
    to: str = "merged",
    out: str | Path | None = None,
    qtype: str = "f16",
    lora_only: bool = False,
    onto: str = "dequantized",
    prompts: list[str] | None = None,
    prompt_count: int = PROMPTS,
    tokens: int = TOKENS,
) -> ExportResult:
    """Export the run in ``adapter_dir``; raise ExportParityError when an export is beyond its thresholds."""
    adapter_dir = Path(adapter_dir).expanduser().resolve()
    _check_choices(to, qtype, onto, lora_only)
    out_dir = Path(out or f"{adapter_dir}-{to}").expanduser().resolve()
    check_output_folder(out_dir, "--out", reading=adapter_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise OutputDirError(f"--out: {out_dir} already holds files; choose an empty or new folder")
    recipe = adapters.recipe_of(adapter_dir)
    check_model_folder(model.resolve_model_path(recipe.model))
    if to == "gguf":
        gguf_writer.require_gguf()
        gguf_writer.family_of(_base_config(recipe))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.exporting-", dir=out_dir.parent))
    try:
        files = _write(recipe, adapter_dir, staging, to, qtype, lora_only, onto)
        report = {
            "adapter": str(adapter_dir),
            "to": to,
            "type": qtype if to == "gguf" else recipe.quant.compute_dtype,
            "lora_only": lora_only,
            "onto": onto,
            "base_difference": base_difference(recipe),
            "files": files,
        }
        report.update(verify(adapter_dir, staging, report, prompts, prompt_count, tokens))
        (staging / REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if report["failures"]:
        raise ExportParityError(f"{report['failures'][0]}; left in {staging}")
    if out_dir.exists():
        out_dir.rmdir()  # empty, checked above
    os.replace(staging, out_dir)
    return ExportResult(out_dir, report)


def _check_choices(to: str, qtype: str, onto: str, lora_only: bool) -> None:
    if to not in TARGETS:
        raise ExportError(f"--to: must be one of {', '.join(TARGETS)} (got {to!r})")
    if qtype not in gguf_writer.TYPES:
        raise ExportError(f"--type: must be one of {', '.join(gguf_writer.TYPES)} (got {qtype!r})")
    if onto not in ONTO:
        raise ExportError(f"--onto: must be one of {', '.join(ONTO)} (got {onto!r})")
    if lora_only and to != "gguf":
        raise ExportError("--lora-only: only with --to gguf (a merged folder has no separate adapter)")


def _base_config(recipe):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(
        model.resolve_model_path(recipe.model), trust_remote_code=recipe.model.trust_remote_code
    )


def _write(recipe, adapter_dir: Path, folder: Path, to: str, qtype: str, lora_only: bool, onto: str) -> dict:
    """The export's files in ``folder``; their names by role."""
    if to == "merged":
        write_merged(recipe, adapter_dir, folder, onto)
        return {"merged": "."}
    name = adapter_dir.name
    with tempfile.TemporaryDirectory(prefix=".merged-", dir=folder.parent) as scratch:
        merged = Path(scratch)
        if lora_only:
            # the base the adapter applies to, in the same onto semantics, and the adapter alone
            write_merged(recipe, None, merged, onto)
            gguf_writer.write_model_gguf(merged, folder / "base.gguf", qtype, name)
            gguf_writer.write_lora_gguf(adapter_dir, _base_config(recipe), folder / "adapter.gguf")
            files = {"gguf": "base.gguf", "lora": "adapter.gguf"}
        else:
            write_merged(recipe, adapter_dir, merged, onto)
            gguf_writer.write_model_gguf(merged, folder / "model.gguf", qtype, name)
            # the merged folder is kept for the report's quantization comparison, then dropped
            shutil.copytree(merged, folder / ".merged")
            files = {"gguf": "model.gguf"}
    modelfile.write_modelfile(recipe, adapter_dir, folder, files)
    files["modelfile"] = "Modelfile"
    return files


def verify(
    adapter_dir: Path, folder: Path, report: dict, prompts: list[str] | None, count: int, tokens: int
) -> dict:
    """The parity figures of every reader of the export in ``folder``, and the failures among them (an
    export a reader cannot load, a truncated file say, is one)."""
    recipe = adapters.recipe_of(adapter_dir)
    readers = list(_readers(folder, report))
    if not readers:  # a LoRA GGUF without llama.cpp: nothing independent can read it
        return {"prompts": 0, "tokens": tokens, "comparisons": [], "failures": []}
    reference = parity.reference_of(adapter_dir, recipe, prompts, count, tokens)
    comparisons, failures = [], []
    kind = report["type"] if report["to"] == "gguf" else "merged"
    for label, open_reader, against in readers:
        try:
            reader = open_reader()
            if reader is None:
                continue
            against_what = (
                reference if against == "trained" else parity.reference_from_reader(reference, reader[1])
            )
            comparison = parity.compare(against_what, reader[0], label, against)
        except Exception as exc:  # a file no reader can load is the report's finding, not a crash
            failures.append(f"{label} cannot be read: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        finally:
            parity.free_memory()
        # onto=original is asked for knowing it is not what the adapter trained against: its distance
        # from the trained model is reported, not judged (its GGUF's quantization drift still is)
        judged = not (against == "trained" and report["onto"] == "original")
        failures += _judge(comparison, THRESHOLDS.get((kind, against)) if judged else None)
        comparisons.append(comparison.as_dict())
    shutil.rmtree(folder / ".merged", ignore_errors=True)
    return {
        "prompts": len(reference.prompts),
        "tokens": tokens,
        "comparisons": comparisons,
        "failures": failures,
    }


def check_export(adapter_dir: str | Path, export_dir: str | Path, **kwargs) -> dict:
    """The parity report of an export made earlier (its export_report.json says what it holds)."""
    adapter_dir, export_dir = (
        Path(adapter_dir).expanduser().resolve(),
        Path(export_dir).expanduser().resolve(),
    )
    path = export_dir / REPORT
    if not path.is_file():
        raise ExportError(f"--check: {export_dir} has no {REPORT}; it was not written by qlora-kit export")
    report = json.loads(path.read_text(encoding="utf-8"))
    report.update(
        verify(
            adapter_dir,
            export_dir,
            report,
            kwargs.get("prompts"),
            kwargs.get("prompt_count", PROMPTS),
            kwargs.get("tokens", TOKENS),
        )
    )
    return report


def _readers(folder: Path, report: dict):
    """(label, open, against): every independent reader of what ``folder`` holds, opened on demand;
    ``open`` gives (reader, None) or, for a comparison against the merged model, (reader, merged reader)."""
    files = report["files"]
    if report["to"] == "merged":
        yield "merged", lambda: (parity.transformers_reader(folder), None), "trained"
        return
    gguf, lora = folder / files["gguf"], folder / files.get("lora", "")
    if report["lora_only"]:
        if not parity.llama_cpp_installed():
            return  # transformers reads no LoRA GGUF: without llama.cpp there is no independent reader
        label = f"{files['gguf']} + {files['lora']}"
        yield label, lambda: _pair(parity.llama_cpp_reader(gguf, lora=lora)), "trained"
        return
    yield files["gguf"], lambda: (parity.transformers_reader(folder, files["gguf"]), None), "trained"
    if (folder / ".merged").is_dir():
        # against the merged model, so quantization drift is told apart from merge drift
        yield (
            files["gguf"],
            lambda: (
                parity.transformers_reader(folder, files["gguf"]),
                parity.transformers_reader(folder / ".merged"),
            ),
            "merged",
        )
    if parity.llama_cpp_installed():
        yield files["gguf"], lambda: _pair(parity.llama_cpp_reader(gguf)), "trained"


def _pair(reader):
    return None if reader is None else (reader, None)


def _judge(comparison: parity.Comparison, threshold: Threshold | None) -> list[str]:
    """One line per figure beyond its threshold (and per prompt or template that differs)."""
    where = f"{comparison.export} read by {comparison.reader} against the {comparison.against} model"
    failures = []
    if comparison.prompt_ids_match is False:
        failures.append(f"{where}: the prompt's token ids differ from training's (BOS or tokenizer)")
    if comparison.template_match is False:
        failures.append(f"{where}: the chat template renders a different prompt than the tokenizer's")
    if threshold is None:
        return failures
    if comparison.max_abs_logit > threshold.max_abs_logit:
        failures.append(f"{where}: max |Δ logit| {comparison.max_abs_logit:.4g} > {threshold.max_abs_logit}")
    if comparison.mean_abs_logit > threshold.mean_abs_logit:
        failures.append(
            f"{where}: mean |Δ logit| {comparison.mean_abs_logit:.4g} > {threshold.mean_abs_logit}"
        )
    if comparison.greedy_agreement < threshold.min_greedy_agreement:
        failures.append(
            f"{where}: greedy agreement {comparison.greedy_agreement:.1%} < {threshold.min_greedy_agreement:.0%}"
        )
    comparison.failures = failures
    return failures


def base_difference(recipe) -> dict | None:
    """How far the dequantized 4-bit weights are from the 16-bit checkpoint they came from (what
    ``onto=original`` adds to the merge): per quantized layer ||W_original - W_dequantized|| / ||W_original||."""
    from bitsandbytes.functional import dequantize_4bit
    from safetensors import safe_open

    folder = Path(model.resolve_model_path(recipe.model))
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        return None  # a hub id or a checkpoint without safetensors: no original to compare
    where = {}
    for shard in shards:
        with safe_open(shard, "pt") as tensors:
            where.update(dict.fromkeys(tensors.keys(), shard))
    quantized = model.load_base_model(recipe.model, recipe.quant)
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
    del quantized
    parity.free_memory()
    if not relative:
        return None
    return {
        "layers": len(relative),
        "mean_relative": sum(relative) / len(relative),
        "max_abs": largest,
        "note": "the 4-bit base's rounding: onto=original adds it to the merge, onto=dequantized does not",
    }
