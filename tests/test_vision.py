"""Vision-language QLoRA on the builtin tiny LLaVA: the language model in 4 bits and the vision side in 16,
LoRA on the language model, image rows whose image and prompt tokens are never trained, cut on the text side
only, and bad image input as one line naming the row (model/vision.py, data/images.py)."""

from __future__ import annotations

import json

import bitsandbytes as bnb
import pytest
import torch

from qlora_kit import Recipe
from qlora_kit.data import images
from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.data.prepare import prepare_datasets
from qlora_kit.errors import DataError
from qlora_kit.model import adapters
from qlora_kit.model import loading as model

VLM = "builtin:tiny-llava"
IMAGE_TOKENS = 17  # (56 / 14)^2 patches and CLIP's class token


def vlm_recipe(path: str = "builtin:shapes", model_path: str = VLM, **sections) -> Recipe:
    values = {
        "model": {"path": model_path},
        "data": {"path": path, "format": "chat", "packing": False, "max_seq_len": 64},
        "quant": {"compute_dtype": "float32"},
        "lora": {"dropout": 0.0},
    }
    for name, fields in sections.items():
        values[name] = {**values.get(name, {}), **fields}
    return Recipe.from_dict(values)


@pytest.mark.slow  # loads the model or prepares every image row
def test_the_language_model_loads_in_4_bits_and_the_vision_side_stays_in_16():
    """From the loaded modules: every 4-bit layer is the language model's; the vision tower and projector
    are plain linears unless quant.vision; LoRA adapts the language model only unless lora.vision."""
    recipe = vlm_recipe()
    base = model.load_base_model(recipe.model, recipe.quant)
    four_bit = [n for n, m in base.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert four_bit and all(".language_model." in n for n in four_bit)
    vision_linears = [
        m for n, m in base.named_modules() if "vision_tower" in n and isinstance(m, torch.nn.Linear)
    ]
    assert vision_linears and all(m.weight.dtype == torch.float32 for m in vision_linears)
    trainable = [n for n, p in adapters.attach_lora(base, recipe.lora).named_parameters() if p.requires_grad]
    assert trainable and all(".language_model." in n for n in trainable)

    both = vlm_recipe(quant={"vision": True}, lora={"vision": True})
    base = model.load_base_model(both.model, both.quant)
    assert any("vision_tower" in n for n, m in base.named_modules() if isinstance(m, bnb.nn.Linear4bit))
    trainable = [n for n, p in adapters.attach_lora(base, both.lora).named_parameters() if p.requires_grad]
    assert any("vision_tower" in n for n in trainable) and any(
        "multi_modal_projector" in n for n in trainable
    )


@pytest.mark.slow  # loads the model or prepares every image row
def test_an_image_row_trains_its_answer_only_never_an_image_or_prompt_token():
    recipe = vlm_recipe()
    runs = images.image_runs(recipe.model)
    tokenizer = runs.processor.tokenizer
    prepared = prepare_datasets(recipe.data, tokenizer, recipe.train.seed, runs=runs)
    rows = prepared.val_rows if prepared.val_rows is not None else None
    assert rows is not None and prepared.val is not None
    for index in range(8):
        example, row = prepared.val[index], rows[index]
        ids, labels = example["input_ids"], example["labels"]
        image = [i for i, token in enumerate(ids) if token == runs.marker_id]
        assert len(example["images"]) == 1 and len(image) == IMAGE_TOKENS
        assert image == list(range(image[0], image[0] + IMAGE_TOKENS))  # one unbroken run
        assert all(labels[i] == IGNORE_INDEX for i in image)
        trained = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
        assert trained and all(labels[i] == IGNORE_INDEX for i in range(trained[0]))  # the prompt
        answer = row["messages"][1]["content"][0]["text"]
        assert tokenizer.decode([ids[i] for i in trained]) == answer + "<|im_end|>"


def test_a_cut_never_falls_inside_an_image_and_takes_the_images_past_it():
    run = [9] * 10
    example = {
        "input_ids": [1, 2, 3, *run, 4, 5, *run, 6],
        "labels": [IGNORE_INDEX] * 25 + [6],
        "images": ["a.png", "b.png"],
        "spans": [(3, 13), (15, 25)],
    }
    inside_second = images.cut(example, 20)  # would split the second image: cut before it
    assert inside_second["input_ids"] == [1, 2, 3, *run, 4, 5] and inside_second["images"] == ["a.png"]
    inside_first = images.cut(example, 7)
    assert inside_first["input_ids"] == [1, 2, 3] and inside_first["images"] == []
    whole = images.cut(example, 26)
    assert whole["images"] == ["a.png", "b.png"] and len(whole["input_ids"]) == 26


def write_rows(path, rows) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def chat_row(image: str, answer: str = "red") -> dict:
    return {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "image", "path": image}, {"type": "text", "text": "Colour?"}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
    }


def test_bad_image_input_is_one_line_naming_the_file_and_row(tmp_path):
    from PIL import Image

    Image.new("RGB", (56, 56), "red").save(tmp_path / "red.png")
    (tmp_path / "broken.png").write_text("not an image")
    cases = {
        "missing.jsonl": ([chat_row("red.png"), chat_row("gone.png")], "row 2: image gone.png: no such file"),
        "broken.jsonl": ([chat_row("broken.png")], "row 1: image broken.png: cannot be read as an image"),
    }
    recipe = vlm_recipe(str(tmp_path / "missing.jsonl"))
    runs = images.image_runs(recipe.model)
    for name, (rows, line) in cases.items():
        write_rows(tmp_path / name, rows)
        data = recipe.data.model_copy(update={"path": str(tmp_path / name)})
        with pytest.raises(DataError) as error:
            prepare_datasets(data, runs.processor.tokenizer, 0, runs=runs)
        assert line in str(error.value) and name in str(error.value) and "\n" not in str(error.value)

    sharegpt = {
        "conversations": [
            {"from": "human", "value": "<image> and <image>: colours?"},
            {"from": "gpt", "value": "red"},
        ],
        "images": ["red.png"],
    }
    write_rows(tmp_path / "sharegpt.jsonl", [sharegpt])
    data = recipe.data.model_copy(update={"path": str(tmp_path / "sharegpt.jsonl"), "format": "sharegpt"})
    with pytest.raises(DataError, match=r"row 1: 1 images in the images column but 2 <image> markers"):
        prepare_datasets(data, runs.processor.tokenizer, 0, runs=runs)

    text_only = vlm_recipe(str(tmp_path / "missing.jsonl"), model_path="builtin:tiny-llama")
    write_rows(tmp_path / "missing.jsonl", [chat_row("red.png")])
    tokenizer = model.load_tokenizer(text_only.model)
    with pytest.raises(DataError, match=r"row 1: 1 image\(s\) in a row for a text-only model"):
        prepare_datasets(text_only.data, tokenizer, 0)


def test_sharegpt_rows_take_their_images_from_the_images_column(tmp_path):
    from PIL import Image

    Image.new("RGB", (56, 56), "blue").save(tmp_path / "blue.png")
    row = {
        "conversations": [
            {"from": "human", "value": "<image>What colour?"},
            {"from": "gpt", "value": "blue"},
        ],
        "images": ["blue.png"],
    }
    write_rows(tmp_path / "rows.jsonl", [row, row])
    recipe = vlm_recipe(str(tmp_path / "rows.jsonl"), data={"format": "sharegpt"})
    runs = images.image_runs(recipe.model)
    prepared = prepare_datasets(recipe.data, runs.processor.tokenizer, 0, runs=runs)
    example = prepared.train[0]
    assert example["images"] == [str((tmp_path / "blue.png").resolve())]
    assert example["input_ids"].count(runs.marker_id) == IMAGE_TOKENS


@pytest.mark.slow  # loads the model or prepares every image row
def test_qlora_kit_data_shows_an_image_as_one_mark_with_its_size_and_tokens():
    from qlora_kit.data.report import inspect_data

    recipe = vlm_recipe()
    view = inspect_data(recipe, images.image_runs(recipe.model).processor.tokenizer, count=2)
    for runs in view.examples:
        marks = [(text, trained) for text, trained in runs if text.startswith("[image")]
        assert marks == [(f"[image 56x56: {IMAGE_TOKENS} tokens]", False)]
        assert next(text for text, trained in runs if trained).endswith("<|im_end|>")


@pytest.mark.slow  # loads the model or prepares every image row
def test_image_rows_are_padded_not_packed(monkeypatch):
    """data.packing: true is one line (packing image rows is not built); auto chooses among the padded
    layouts only."""
    from qlora_kit.data import layout
    from qlora_kit.errors import RecipeError
    from qlora_kit.training.pipeline import _resolve_layout

    recipe = vlm_recipe(data={"packing": True})
    runs = images.image_runs(recipe.model)
    with pytest.raises(RecipeError, match=r"^data\.packing: a vision-language model's rows are padded"):
        prepare_datasets(recipe.data, runs.processor.tokenizer, 0, runs=runs)
    auto = vlm_recipe(data={"packing": "auto"})
    prepared = prepare_datasets(auto.data, runs.processor.tokenizer, 0, runs=runs)
    offered = []
    choose = layout.choose_layout
    monkeypatch.setattr(
        layout, "choose_layout", lambda shares, allowed: offered.append(allowed) or choose(shares, allowed)
    )
    resolved, _ = _resolve_layout(auto, prepared)
    assert resolved.data.packing is False and offered == [("padding", "group_by_length")]
