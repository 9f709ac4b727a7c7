"""Every after-training command on a run of every model kind in the families table (dense, mixture of
experts, vision-language, layers of different sizes): it runs, or it refuses in one line naming why. And a vision-language run
exported to a merged folder, as plain transformers reads it back, on an image row.

One short run per kind, trained once for the module (2 steps on a tiny builtin; the dense one is the
session's finished run): the commands read them, never write into them.
"""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from qlora_kit.registries import families as table
from tests.conftest import quick_recipe, run_cli_output

pytestmark = pytest.mark.slow  # trains a run per kind

VLMS = [f"builtin:{f.tiny}" for f in table.FAMILIES.values() if f.vision is not None]
MIXTURE = "builtin:tiny-qwen2-moe"  # routed experts and a shared expert
SIZES = "builtin:tiny-gemma4"  # layers of two head sizes, shared keys and values, per-layer embeddings
SMALL = {"prompt_count": 2, "tokens": 4}  # parity on 2 rows, 4 greedy tokens each


def image_rows(folder):
    """A few rows of builtin:shapes' kind (4 training images, 2 held out; 2 questions each): a vision run's
    data, small enough that preparing it is not the test's cost."""
    from qlora_kit.data import shapes

    return shapes.write_split(folder, "train", 4, seed=1), shapes.write_split(folder, "val", 2, seed=2)


def train_run(model: str, folder) -> object:
    from qlora_kit import train

    settings = {"model.path": model, "train.max_steps": 2, "train.micro_batch_size": 2}
    if model in VLMS:
        rows, held_out = image_rows(folder / "data")
        settings |= {"data.path": str(rows), "data.val_path": str(held_out), "data.format": "chat"}
        settings |= {"data.packing": False, "data.max_seq_len": 96, "quant.compute_dtype": "float32"}
    if model != "builtin:tiny-llama":
        settings["lora.dropout"] = 0.0  # a mixture's 4-bit experts take none (peft's rule)
    return train(quick_recipe(folder / "run", **settings)).output_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory, finished_run):
    """A kind (dense, mixture, vision) or a builtin -> its run's folder, trained on first use."""
    made = {"builtin:tiny-llama": finished_run}

    def run(kind: str):
        model = {"dense": "builtin:tiny-llama", "mixture": MIXTURE, "vision": VLMS[0], "sizes": SIZES}.get(
            kind, kind
        )
        if model not in made:  # the vision kind's run is the first VLM's: trained once for both tests
            made[model] = train_run(model, tmp_path_factory.mktemp(model.replace(":", "-")))
        return made[model]

    return run


# --- a vision-language run exported merged, read back by plain transformers on an image row ---


@pytest.mark.parametrize("vlm", VLMS)
def test_a_vision_language_run_exports_merged_and_transformers_reads_it_on_an_image_row(vlm, runs, tmp_path):
    """The parity report is computed on the run's image rows (their pixels through the vision tower), and
    the folder, loaded by transformers' own class and processor, gives on a held-out image row the trained
    model's logits within what its weights' rounding allows (merge's derived bound: after/drift_bounds.py)."""
    from PIL import Image
    from transformers import AutoConfig, AutoModelForImageTextToText

    from qlora_kit import export
    from qlora_kit.after import drift_bounds, floor, parity
    from qlora_kit.after.parity import kl_per_position
    from qlora_kit.model import adapters, vision

    run = runs(vlm)
    result = export(run, "merged", out=tmp_path / "merged", **SMALL)
    report = result.report
    assert report["failures"] == [] and report["prompts"] == 2 and report["prompts_from"] == "validation rows"
    # the report's prompts were the held-out rows with their images (the reference the export computed)
    asked = parity.reference_of(run, adapters.recipe_of(run), None, SMALL["prompt_count"], SMALL["tokens"])
    assert asked.images and all(len(files) == 1 for files in asked.images)

    # transformers' AutoProcessor, or where torchvision does not import (Qwen-VL's video half needs it), its
    # processor class made of the folder's image processor and tokenizer (model/vision.py)
    config = AutoConfig.from_pretrained(tmp_path / "merged")
    processor = vision.load_processor(str(tmp_path / "merged"), vision=vision.vision_of(config))
    merged = AutoModelForImageTextToText.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    data = run.parent / "data"
    image, question = json.loads((data / "val.jsonl").read_text().splitlines()[0])["messages"][0]["content"]
    picture = Image.open(data / image["path"]).convert("RGB")
    messages = [{"role": "user", "content": [{"type": "image"}, question]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=[picture], return_tensors="pt")
    _, _, trained = floor.load_trained_exactly(run, adapters.recipe_of(run))
    with torch.no_grad():
        expected = trained.eval()(**inputs).logits[0].float()
        got = merged(**inputs).logits[0].float()
    kl = float(kl_per_position(expected, got).mean())
    # the folder's float16 weights and float32's roundoff through the model's products, at this row's
    # positions: what a correct merged folder may drift from the trained model (merge's own bound)
    roundoff, passes = drift_bounds.weight_roundoff(tmp_path / "merged"), drift_bounds.rounding_passes(config)
    allowed = drift_bounds.bound(drift_bounds.expected_kl(expected.log_softmax(-1), roundoff, passes))
    assert kl <= allowed, (kl, allowed)
    assert (expected.argmax(-1) == got.argmax(-1)).float().mean() >= 0.95


# --- every after-training command on every model kind: it runs, or refuses in one line naming why ---

KINDS = ("dense", "mixture", "vision", "sizes")
NO_GGUF = {
    "mixture": "'qwen2_moe' is not supported",
    "vision": "'llava' is not supported",
    "sizes": "'gemma4_text' is not supported",
}
# (kind, command) -> the refusal's words; every pair not listed runs (exit 0)
REFUSED = {
    **{(kind, "export-gguf"): why for kind, why in NO_GGUF.items()},
    **{(kind, "export-lora-gguf"): why for kind, why in NO_GGUF.items()},
}
# what a command that runs leaves behind (the others print: their output is checked not to be empty)
PRODUCES = {
    "eval": "eval.json",
    "merge": "merged/config.json",
    "export-merged": "out/export_report.json",
    "export-gguf": "out/model.gguf",
    "export-lora-gguf": "out/adapter.gguf",
}
COMMANDS = ("eval", "generate", "chat", "show", "merge", "export-merged", "export-gguf", "export-lora-gguf")


def command_line(command: str, run, kind: str, folder) -> list[str]:
    """``command``'s arguments on ``run``, each as short as the command allows (one prompt, a few tokens)."""
    picture = (
        ["--image", str(next((run.parent / "data" / "images").glob("val-*.png")))] if kind == "vision" else []
    )
    prompts = folder / "prompts.jsonl"
    prompts.write_text('{"prompt": "What colour is the square?"}\n')
    # a vision run's parity prompts are its image rows (4 held out): through the vision path, not --prompts
    asked = [] if kind == "vision" else ["--prompts", str(prompts)]
    # the report's smallest size: a vision run's 4 image rows cut to 2, each row's greedy tokens to 4
    export = ["export", "--adapter", str(run), *asked, "--prompt-count", "2", "--tokens", "4"]
    export += ["--out", str(folder / "out")]
    return {
        "eval": ["eval", "--adapter", str(run), "--max-examples", "2", "--output", str(folder / "eval.json")],
        "generate": ["generate", "--adapter", str(run), "Hi", "--max-new-tokens", "4", *picture],
        "chat": ["chat", "--adapter", str(run), "--max-new-tokens", "4", *picture],
        "show": ["show", str(run)],
        "merge": ["merge", "--adapter", str(run), "--out", str(folder / "merged")],
        "export-merged": [*export, "--to", "merged"],
        "export-gguf": [*export, "--to", "gguf"],
        "export-lora-gguf": [*export, "--to", "gguf", "--lora-only"],
    }[command]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", COMMANDS)
def test_every_after_training_command_runs_or_refuses_in_one_line_on_every_kind(
    command, kind, runs, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hi\n\n"))  # chat: one turn, then an empty line ends it
    code, out, err = run_cli_output(command_line(command, runs(kind), kind, tmp_path), monkeypatch, capsys)
    refusal = REFUSED.get((kind, command))
    if refusal is None:
        assert code == 0, err[-2000:]
        made = PRODUCES.get(command)
        assert (tmp_path / made).is_file() if made else out.strip(), (command, out[-2000:])
        return
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and refusal in lines[0], err
    assert not (tmp_path / "out").exists()
