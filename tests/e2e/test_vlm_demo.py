"""The vision-language demo through the CLI, as a user runs it: train, evaluate, merge.

`qlora-kit train recipes/demo-vlm.yaml` (the shipped recipe, unchanged) on the builtin shapes images: the
held-out images' exact-match accuracy rises from the base's (`qlora-kit eval`), the run folder holds the
processor and reloads with plain peft onto the 16-bit model (the same logits within the dense models'
tolerance), `generate --image` and `chat --image` answer about an image, and `merge` writes a folder
transformers' own class and processor load."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from .test_cli import ROOT

pytestmark = pytest.mark.slow  # end to end: the full suite runs it, the inner loop skips it

RECIPE = str(ROOT / "recipes" / "demo-vlm.yaml")


def test_vlm_demo_learns_the_held_out_images_from_the_shell_and_merges(tmp_path, qlora_kit_here, monkeypatch):
    """The README's commands in this process (the README's first command as a process of its own is
    conftest's demo_run, chat reading a process's stdin test_cli's): train, eval, generate, chat and merge."""
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText, AutoProcessor

    out = tmp_path / "demo-vlm"
    trained = qlora_kit_here("train", RECIPE, "--output-dir", out)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert (out / "processor_config.json").is_file()
    accuracy = {}
    # the base answers none (its head is random): 16 of its questions show it; the trained run gets all 48
    for name, where in (
        ("base", ["--no-adapter", RECIPE, "--max-examples", "16"]),
        ("trained", ["--adapter", str(out)]),
    ):
        result = qlora_kit_here("eval", *where, "--output", str(tmp_path / f"{name}.json"))
        assert result.returncode == 0, result.stderr[-3000:]
        accuracy[name] = json.loads((tmp_path / f"{name}.json").read_text())["exact_match"]
    assert accuracy["trained"] >= accuracy["base"] + 0.3, accuracy

    # generate --image: an answer of the kind trained (a colour), and a missing image is one line
    from qlora_kit.data.shapes import COLOURS

    image = _a_red_square(tmp_path)
    answered = qlora_kit_here(
        "generate", "--adapter", str(out), "What colour is the square?", "--image", str(image)
    )
    assert answered.returncode == 0, answered.stderr[-2000:]
    assert answered.stdout.strip().splitlines()[-1].strip() in COLOURS, answered.stdout
    missing = qlora_kit_here("generate", "--adapter", str(out), "Hi", "--image", str(tmp_path / "none.png"))
    assert missing.returncode == 2 and missing.stderr.strip().endswith("none.png: no such file")
    # chat --image: two turns about the image (the second sees it again through the history)
    monkeypatch.setattr(
        sys, "stdin", io.StringIO("What colour is the square?\nHow many squares are there?\n\n")
    )
    talk = qlora_kit_here("chat", "--adapter", out, "--image", image)
    assert talk.returncode == 0, talk.stderr[-2000:]
    answers = [line.split("model>", 1)[1].strip() for line in talk.stdout.splitlines() if "model>" in line]
    assert len(answers) == 2 and answers[0] in COLOURS, talk.stdout

    merged = tmp_path / "merged"
    result = qlora_kit_here("merge", "--adapter", str(out), "--out", str(merged))
    assert result.returncode == 0, result.stderr[-3000:]
    processor = AutoProcessor.from_pretrained(merged)
    lm = AutoModelForImageTextToText.from_pretrained(merged).eval()
    base_folder = json.loads((out / "manifest.json").read_text())["base_model"]["path"]
    plain = PeftModel.from_pretrained(
        AutoModelForImageTextToText.from_pretrained(base_folder), str(out)
    ).eval()
    from PIL import Image

    image = Image.new("RGB", (56, 56), "white")
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}],
        }
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=text, images=[image], return_tensors="pt")
    with torch.no_grad():
        ours, theirs = lm(**inputs).logits.float(), plain(**inputs).logits.float()
        with plain.disable_adapter():
            without = plain(**inputs).logits.float()
    scale = theirs.abs().max()
    assert (ours - theirs).abs().max() < 0.1 * scale  # merged vs plain peft on the 16-bit base
    assert (theirs - without).abs().max() > 0.3 * scale  # the adapter moves the logits more than that


def _a_red_square(folder):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(image).rectangle((10, 10, 30, 30), fill=(220, 40, 40))
    image.save(folder / "square.png")
    return folder / "square.png"
