"""``qlora-kit export``: a trained run as a merged 16-bit folder (transformers, vLLM) or one GGUF file
(llama.cpp, Ollama), checked by the parity report before it is handed over.

Both start from ``merge.write_merged``: the adapter merged in fp32 into the weights it was trained
against (``onto="dequantized"``: the 4-bit base dequantized) or into the 16-bit checkpoint the 4-bit base
came from (``onto="original"``); the report gives the difference between the two bases either way. A
merged folder is that merge rounded once into ``dtype``; a GGUF is written from the fp32 merge
(``gguf_writer``: rounded once, into its type), with an Ollama ``Modelfile``; ``lora_only`` writes the
adapter as a LoRA GGUF beside a GGUF of the base it applies to. Everything is made in a staging folder
beside the destination and moved there only when every comparison of the report (``parity``) is within
what the floor of the export's type allows (``floor``); otherwise ``ExportParityError`` names the figure
and the staging folder is kept (``force`` writes it anyway, its failures in the report).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from qlora_kit.after import drift_bounds, floor, gguf_writer, modelfile, parity, replay
from qlora_kit.after.floor import MERGED_DTYPES, free_memory
from qlora_kit.after.image_parity import ImageInputs
from qlora_kit.after.merge import MERGED_DTYPE, save_merged, write_merged
from qlora_kit.after.parity_judgement import FloorBounds, greedy_causes, judge
from qlora_kit.data import images
from qlora_kit.errors import ExportError, ExportParityError, OutputDirError
from qlora_kit.model import adapters
from qlora_kit.model import loading as model
from qlora_kit.model.paths import check_model_folder, check_output_folder

TARGETS = ("merged", "gguf")
ONTO = ("dequantized", "original")
PROMPTS = 16
TOKENS = 16
REPORT = "export_report.json"


# Every export is judged against the floor its own type sets: the trained model's effective weights (fp32)
# rounded into that type in memory (after/floor.py), read under teacher forcing on the same answer tokens,
# and against the trained model itself (computed in float32: floor.load_trained_exactly). How far a file
# may read from its floor is derived per export from its reader's arithmetic, the layers and the floor's
# own distributions (after/parity_judgement.py); against the trained model, the floor's own distance plus
# that.


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
    dtype: str = MERGED_DTYPE,
    force: bool = False,
) -> ExportResult:
    """Export the run in ``adapter_dir``; raise ExportParityError when an export is beyond its thresholds
    (unless ``force``: then it is written with its failures in the report)."""
    adapter_dir = Path(adapter_dir).expanduser().resolve()
    _check_choices(to, qtype, onto, lora_only, dtype)
    _check_size(prompt_count, tokens)
    out_dir = Path(out or f"{adapter_dir}-{to}").expanduser().resolve()
    check_output_folder(out_dir, "--out", reading=adapter_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise OutputDirError(f"--out: {out_dir} already holds files; choose an empty or new folder")
    recipe = adapters.recipe_of(adapter_dir)
    check_model_folder(model.resolve_model_path(recipe.model))
    if to == "gguf":
        gguf_writer.require_gguf()
        form = gguf_writer.family_of(_base_config(recipe))
        if not form.transformers_reads and not parity.llama_cpp_installed():
            raise ExportError(
                "export --to gguf: transformers' GGUF loader reads this architecture's file as another, so "
                "llama.cpp is the parity report's one reader, and it is not installed: "
                "bash scripts/install_llama_cpp.sh"
            )
        if lora_only:
            gguf_writer.check_lora_form(adapter_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.exporting-", dir=out_dir.parent))
    try:
        kind = qtype if to == "gguf" else dtype
        made = _Made(recipe)
        if to == "gguf" and not lora_only:  # its floor is computed from the merge it is written from
            made.reference = parity.reference_of(adapter_dir, recipe, prompts, prompt_count, tokens)
        files = _write(recipe, adapter_dir, staging, to, kind, lora_only, onto, made)
        report = {
            "adapter": str(adapter_dir),
            "to": to,
            "type": kind,
            "lora_only": lora_only,
            "onto": onto,
            "base_difference": made.base_difference if made.measured_base else floor.base_difference(recipe),
            "files": files,
        }
        if made.floor is not None:  # for a --check of this export in the same process
            _remember_floor(report, made.reference, made.floor)
        report.update(verify(adapter_dir, staging, report, prompts, prompt_count, tokens, made.floor))
        (staging / REPORT).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if report["failures"] and not force:
        raise ExportParityError(f"{report['failures'][0]}; left in {staging}; --force exports it anyway")
    if out_dir.exists():
        out_dir.rmdir()  # empty, checked above
    os.replace(staging, out_dir)
    return ExportResult(out_dir, report)


def _check_choices(to: str, qtype: str, onto: str, lora_only: bool, dtype: str) -> None:
    if to not in TARGETS:
        raise ExportError(f"--to: must be one of {', '.join(TARGETS)} (got {to!r})")
    if qtype not in gguf_writer.TYPES:
        raise ExportError(f"--type: must be one of {', '.join(gguf_writer.TYPES)} (got {qtype!r})")
    if onto not in ONTO:
        raise ExportError(f"--onto: must be one of {', '.join(ONTO)} (got {onto!r})")
    if dtype not in MERGED_DTYPES:
        raise ExportError(f"--dtype: must be one of {', '.join(MERGED_DTYPES)} (got {dtype!r})")
    if lora_only and to != "gguf":
        raise ExportError("--lora-only: only with --to gguf (a merged folder has no separate adapter)")


def _check_size(prompt_count: int, tokens: int) -> None:
    """The parity report's size: at least one prompt and one compared token."""
    for option, value in (("--prompt-count", prompt_count), ("--tokens", tokens)):
        if value < 1:
            raise ExportError(f"{option}: must be at least 1 (got {value})")


def _base_config(recipe):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(
        model.resolve_model_path(recipe.model), trust_remote_code=recipe.model.trust_remote_code
    )


class _Made:
    """What writing an export measures on the way, so that its report loads no model a second time: the
    4-bit base's difference from its checkpoint, read from the merge's own 4-bit load (onto dequantized),
    and a GGUF's floor, the merge it was written from rounded into its type (``reference`` given)."""

    def __init__(self, recipe) -> None:
        self.recipe, self.reference, self.floor = recipe, None, None
        self.base_difference, self.measured_base = None, False

    def four_bit_seen(self, four_bit) -> None:
        self.base_difference, self.measured_base = floor.base_difference_of(self.recipe, four_bit), True


def _write(
    recipe, adapter_dir: Path, folder: Path, to: str, kind: str, lora_only: bool, onto: str, made: _Made
) -> dict:
    """The export's files in ``folder``; their names by role. A GGUF is written from an fp32 merge, so its
    weights are rounded once, into its own type."""
    if to == "merged":
        write_merged(recipe, adapter_dir, folder, onto, kind, made.four_bit_seen)
        return {"merged": "."}
    name = adapter_dir.name
    with tempfile.TemporaryDirectory(prefix=".merged-", dir=folder.parent) as scratch:
        merged = Path(scratch)
        if lora_only:
            # the base the adapter applies to, in the same onto semantics, and the adapter alone
            write_merged(recipe, None, merged, onto, "float32", made.four_bit_seen)
            gguf_writer.write_model_gguf(merged, folder / "base.gguf", kind, name)
            gguf_writer.write_lora_gguf(adapter_dir, _base_config(recipe), folder / "adapter.gguf")
            files = {"gguf": "base.gguf", "lora": "adapter.gguf"}
        else:
            # the fp32 merge saved, then rounded in place into the type for the floor (one merge, not
            # two) and let go before the file is written from what was saved
            lm = floor.merged_model(recipe, adapter_dir, onto, made.four_bit_seen)
            save_merged(recipe, adapter_dir, lm, merged)
            made.floor = _floor_of(floor.round_into(lm, kind), recipe, kind, made.reference)
            del lm
            free_memory()
            gguf_writer.write_model_gguf(merged, folder / "model.gguf", kind, name)
            files = {"gguf": "model.gguf"}
    modelfile.write_modelfile(recipe, adapter_dir, folder, files)
    files["modelfile"] = "Modelfile"
    return files


def verify(
    adapter_dir: Path,
    folder: Path,
    report: dict,
    prompts: list[str] | None,
    count: int,
    tokens: int,
    made_floor: tuple | None = None,
) -> dict:
    """The parity figures of every reader of the export in ``folder`` against the trained model and
    against the floor of the export's type, and the failures among them (an export a reader cannot
    load, a truncated file say, is one). ``made_floor``: the floor export computed while writing."""
    recipe = adapters.recipe_of(adapter_dir)
    readers = list(_readers(folder, report, recipe))
    if not readers:  # a LoRA GGUF without llama.cpp: nothing independent can read it
        return {"prompts": 0, "tokens": tokens, "comparisons": [], "failures": []}
    reference = parity.reference_of(adapter_dir, recipe, prompts, count, tokens)
    floor_reference, peak_ratio, rounded_inputs = made_floor or _floor_reference(
        recipe, adapter_dir, report, reference
    )
    floor = parity.compare(
        reference, replay.ReplayReader(floor_reference, "in memory"), _floor_name(report), "trained"
    )
    passes = drift_bounds.rounding_passes(_base_config(recipe))
    bounds = FloorBounds(report["type"], passes, floor_reference.logits, peak_ratio, rounded_inputs)
    comparisons, failures = [floor.as_dict()], []
    # onto=original is asked for knowing it is not what the adapter trained against: its distance
    # from the trained model is reported, not judged (its floor comparison still is)
    judged = report["onto"] != "original"
    for label, open_reader, againsts in readers:
        try:
            reader = open_reader(reference)
            if reader is None:
                continue
            reader = replay.ReadOnce(reader)  # against the trained model and the floor, read once
            for against in againsts:
                comparison = parity.compare(
                    reference if against == "trained" else floor_reference, reader, label, against
                )
                judged_by = floor if judged or against == "floor" else None
                failures += judge(comparison, judged_by, bounds.max_kl(comparison.reader))
                comparisons.append(comparison.as_dict())
        except Exception as exc:  # a file no reader can load is the report's finding, not a crash
            failures.append(f"{label} cannot be read: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            continue
        finally:
            reader = None
            free_memory()
    return {
        "prompts": len(reference.prompts),
        "prompts_from": reference.source,
        "tokens": tokens,
        "comparisons": comparisons,
        "floor_bounds": bounds.as_dict(),
        "greedy_causes": greedy_causes(comparisons, len(reference.prompts)),
        "failures": failures,
    }


def _floor_name(report: dict) -> str:
    return f"floor: the trained weights in {report['type']}"


# The last floor computed, with the reference it was computed for (parity keeps one reference per adapter
# state): an export and its --check in one process (a notebook, the suite) merge and round the model once.
_LAST_FLOOR: dict[tuple, tuple[parity.Reference, tuple]] = {}


def _floor_reference(
    recipe, adapter_dir: Path, report: dict, reference: parity.Reference
) -> tuple[parity.Reference, float, list[torch.Tensor] | None]:
    """The reference's figures read from the trained model's effective weights rounded as the export
    stores them (a LoRA GGUF: the base rounded into its type, the update applied in fp32 as llama.cpp
    applies it), its activations' q8_0 block peaks (drift_bounds.BlockPeaks) and, for q8_0, its answer
    logits with its inputs rounded as llama.cpp's q8_0 products round them (drift_bounds.RoundedInputs)."""
    key = (report["type"], report["onto"], report["lora_only"])
    hit = _LAST_FLOOR.get(key)
    if hit is not None and hit[0] is reference:
        return hit[1]
    computed = _compute_floor(recipe, adapter_dir, report, reference)
    _remember_floor(report, reference, computed)
    return computed


def _remember_floor(report: dict, reference: parity.Reference, computed: tuple) -> None:
    _LAST_FLOOR.clear()
    _LAST_FLOOR[(report["type"], report["onto"], report["lora_only"])] = (reference, computed)


def _compute_floor(
    recipe, adapter_dir: Path, report: dict, reference: parity.Reference
) -> tuple[parity.Reference, float, list[torch.Tensor] | None]:
    merged = floor.merged_model(recipe, adapter_dir, report["onto"])
    if report["lora_only"]:
        base = floor.merged_model(recipe, None, report["onto"])
        with torch.no_grad():
            for (_, weight), (_, base_weight) in zip(
                merged.named_parameters(), base.named_parameters(), strict=True
            ):
                weight.add_(floor.rounded(base_weight.data, report["type"]) - base_weight.data)
        del base
    else:
        floor.round_into(merged, report["type"])
    figures = _floor_of(merged, recipe, report["type"], reference)
    del merged
    free_memory()
    return figures


def _floor_of(
    merged, recipe, kind: str, reference: parity.Reference
) -> tuple[parity.Reference, float, list[torch.Tensor] | None]:
    """The floor's figures from ``merged``, the trained weights already rounded as an export of ``kind``
    stores them."""
    runs = images.image_runs(recipe.model) if reference.images else None  # its image rows' pixels
    reader = parity.TransformersModel(merged, None, ImageInputs(runs) if runs else None)
    peaks = drift_bounds.BlockPeaks(merged)  # the inputs llama.cpp's q8_0 products round
    try:
        figures = parity.reference_from_reader(reference, reader)
    finally:
        peaks.remove()
    rounded_inputs = None
    if kind == "q8_0" and parity.llama_cpp_installed():
        rounding = drift_bounds.RoundedInputs(merged)
        try:
            rounded_inputs = [
                reader.answer_logits(p, a, **reference.images_of(i))
                for i, (p, a) in enumerate(zip(reference.prompts, reference.answers, strict=True))
            ]
        finally:
            rounding.remove()
    return figures, peaks.ratio(), rounded_inputs


def check_export(adapter_dir: str | Path, export_dir: str | Path, **kwargs) -> dict:
    """The parity report of an export made earlier (its export_report.json says what it holds)."""
    adapter_dir, export_dir = (
        Path(adapter_dir).expanduser().resolve(),
        Path(export_dir).expanduser().resolve(),
    )
    path = export_dir / REPORT
    if not path.is_file():
        raise ExportError(f"--check: {export_dir} has no {REPORT}; it was not written by qlora-kit export")
    _check_size(kwargs.get("prompt_count", PROMPTS), kwargs.get("tokens", TOKENS))
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


def _readers(folder: Path, report: dict, recipe):
    """(label, open, againsts): every independent reader of what ``folder`` holds, opened on demand
    (``open`` takes the reference, whose prompts llama.cpp reads in one process)."""
    files = report["files"]
    if report["to"] == "merged":
        yield "merged", lambda _: parity.transformers_reader(folder), ("trained", "floor")
        return
    gguf, lora = folder / files["gguf"], folder / files.get("lora", "")
    llama_cpp = parity.llama_cpp_installed()
    if report["lora_only"]:
        if llama_cpp:  # transformers reads no LoRA GGUF: llama.cpp is the one independent reader
            label = f"{files['gguf']} + {files['lora']}"
            yield label, lambda ref: parity.llama_cpp_reader(gguf, ref, lora=lora), ("trained",)
        return
    # against the floor too, so the writer's own errors are told apart from the type's rounding
    if gguf_writer.family_of(_base_config(recipe)).transformers_reads:
        yield files["gguf"], lambda _: parity.transformers_reader(folder, files["gguf"]), ("trained", "floor")
    if llama_cpp:
        yield files["gguf"], lambda ref: parity.llama_cpp_reader(gguf, ref), ("trained", "floor")
