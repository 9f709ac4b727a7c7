"""Vision-language QLoRA on the builtin tiny LLaVA, Gemma-3 and Qwen2.5-VL (one placeholder per patch
feature; pooled soft tokens between markers, attending to each other both ways; a token count that follows
the image's size, and 3-D positions): the language model in 4 bits and the
vision side in 16, LoRA on the language model, image rows made as the family's own processor makes them
whose image and prompt tokens are never trained, cut on the text side only, packed with each example's
loss its own, and bad image input as one line naming the row (model/vision.py, data/images.py)."""

from __future__ import annotations

import itertools
import json

import bitsandbytes as bnb
import pytest
import torch

from qlora_kit import Recipe
from qlora_kit.data import images
from qlora_kit.data.formats import IGNORE_INDEX
from qlora_kit.data.prepare import build_collator, prepare_datasets
from qlora_kit.errors import DataError
from qlora_kit.model import adapters, vision
from qlora_kit.model import loading as model
from qlora_kit.model.layers import is_linear

VLM = "builtin:tiny-llava"
IMAGE_TOKENS = 17  # (56 / 14)^2 patches and CLIP's class token
VLMS = ["builtin:tiny-llava", "builtin:tiny-gemma3"]
QWEN = "builtin:tiny-qwen2.5-vl"  # dynamic resolution (an image's tokens follow its size) and M-RoPE
QWEN3 = "builtin:tiny-qwen3-vl"  # the same, M-RoPE interleaved, 16-pixel patches, DeepStack features
QWEN3_MOE = "builtin:tiny-qwen3-vl-moe"  # and a mixture of experts in every layer


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
@pytest.mark.parametrize("vlm", [*VLMS, QWEN, QWEN3, QWEN3_MOE])
def test_the_language_model_loads_in_4_bits_and_the_vision_side_stays_in_16(vlm):
    """From the loaded modules: every 4-bit layer is the language model's; the vision tower and projector
    are plain linears unless quant.vision; LoRA adapts the language model only unless lora.vision."""
    recipe = vlm_recipe(model_path=vlm)
    base = model.load_base_model(recipe.model, recipe.quant)
    four_bit = [n for n, m in base.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert four_bit and all(".language_model." in n for n in four_bit)
    facet = vision.vision_of(base.config)
    vision_linears = [
        m
        for n, m in base.named_modules()
        if vision.on_vision_side(n, facet) and isinstance(m, torch.nn.Linear)
    ]
    assert vision_linears and all(m.weight.dtype == torch.float32 for m in vision_linears)
    trainable = [n for n, p in adapters.attach_lora(base, recipe.lora).named_parameters() if p.requires_grad]
    assert trainable and all(".language_model." in n for n in trainable)

    both = vlm_recipe(model_path=vlm, quant={"vision": True}, lora={"vision": True})
    base = model.load_base_model(both.model, both.quant)
    assert any(
        vision.on_vision_side(n, facet) for n, m in base.named_modules() if isinstance(m, bnb.nn.Linear4bit)
    )
    vision_side = [  # Gemma-3's projector has no linear layer (a norm, a pooling and a matrix)
        n
        for n, m in base.named_modules()
        if vision.on_vision_side(n, vision.vision_of(base.config)) and is_linear(m)
    ]
    adapted = {n for n, m in adapters.attach_lora(base, both.lora).named_modules() if hasattr(m, "lora_A")}
    assert vision_side and all(f"base_model.model.{n}" in adapted for n in vision_side)


@pytest.mark.slow  # loads the model or prepares every image row
@pytest.mark.parametrize("vlm", [*VLMS, QWEN, QWEN3, QWEN3_MOE])
def test_an_image_row_is_what_the_processor_makes_and_trains_its_answer_only(vlm):
    """The oracle is transformers' processor of the family, on its own chat template's rendering: the same
    tokens, pixels, (Gemma-3) token types and (Qwen) image grids and token types as a prepared and collated
    row, on images of both sizes of builtin:shapes; and in the row, every token of an image's run and of
    the prompt untrained, the answer and its end-of-turn marker trained. Qwen's batch of both sizes: each
    image its own token count, the grids and pixels of both in order."""
    recipe = vlm_recipe(model_path=vlm)
    runs = images.image_runs(recipe.model)
    processor, tokenizer = runs.processor, runs.processor.tokenizer
    prepared = prepare_datasets(recipe.data, tokenizer, recipe.train.seed, runs=runs)
    assert prepared.val is not None and prepared.val_rows is not None
    collator = images.ImageCollator(build_collator(tokenizer, packing=False), runs)
    for index in range(4):
        example, row = prepared.val[index], prepared.val_rows[index]
        messages = [{"role": m["role"], "content": [_part(p) for p in m["content"]]} for m in row["messages"]]
        picture = images.open_image(example["images"][0])
        theirs = processor(
            text=processor.apply_chat_template(messages),
            images=[picture],
            return_tensors="pt",
            return_mm_token_type_ids=True,
        )
        ours = collator([example])
        assert torch.equal(ours["input_ids"], theirs["input_ids"])
        assert torch.equal(ours["pixel_values"], theirs["pixel_values"])
        types = theirs.get("token_type_ids", theirs.get("mm_token_type_ids"))
        if "token_type_ids" in processor.model_input_names:  # Gemma-3: the model reads them
            assert torch.equal(ours["token_type_ids"], types) and types.sum() > 0
        if runs.vision.mrope:  # Qwen: the grids and token types get_rope_index reads
            assert torch.equal(ours["image_grid_thw"], theirs["image_grid_thw"])
            assert torch.equal(ours["mm_token_type_ids"], theirs["mm_token_type_ids"])
        ids, labels = example["input_ids"], example["labels"]
        run = runs.run(picture)  # the processor's tokens for one image, markers and framing included
        start = next(i for i in range(len(ids)) if ids[i : i + len(run)] == run)
        assert all(labels[i] == IGNORE_INDEX for i in range(start, start + len(run)))
        assert types[0, start : start + len(run)].sum() == types.sum()  # every image token in the run
        trained = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
        assert trained and all(labels[i] == IGNORE_INDEX for i in range(trained[0]))  # the prompt
        answer = row["messages"][1]["content"][0]["text"]
        assert tokenizer.decode([ids[i] for i in trained]) == answer + "<|im_end|>"
    sizes = {images.open_image(prepared.val[i]["images"][0]).size for i in range(4)}
    assert sizes == {(56, 56), (56, 84)}  # builtin:shapes: every other image taller
    if runs.vision.dynamic_resolution:
        square, tall = prepared.val[0], prepared.val[2]
        batch = collator([square, tall])
        alone = [collator([square]), collator([tall])]
        counts = [int((row == runs.marker_id).sum()) for row in batch["input_ids"]]
        assert counts == [4, 6]  # (56 / 28) x (56 / 28) and (56 / 28) x (84 / 28) merged patches
        assert torch.equal(batch["image_grid_thw"], torch.cat([a["image_grid_thw"] for a in alone]))
        assert torch.equal(batch["pixel_values"], torch.cat([a["pixel_values"] for a in alone]))


def _part(part: dict) -> dict:
    """A row's content part as the processor's chat template takes it (the image passed beside)."""
    return {"type": "image"} if part["type"] == "image" else {"type": "text", "text": part["text"]}


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


def test_a_video_part_and_max_pixels_off_qwen_are_one_line_each(tmp_path):
    """torchvision does not import here: a video part says so, naming the row; model.max_pixels on a
    family that does not resize by pixel count names the field."""
    from qlora_kit.errors import RecipeError

    row = chat_row("red.png")
    row["messages"][0]["content"][0] = {"type": "video", "path": "clip.mp4"}
    write_rows(tmp_path / "video.jsonl", [row])
    recipe = vlm_recipe(str(tmp_path / "video.jsonl"))
    runs = images.image_runs(recipe.model)
    with pytest.raises(DataError) as error:
        prepare_datasets(recipe.data, runs.processor.tokenizer, 0, runs=runs)
    assert "row 1: a video part: qlora_kit trains on image parts only" in str(error.value)
    assert "torchvision, which does not import here" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(RecipeError, match=r"^model\.max_pixels: builtin:tiny-llava does not resize images"):
        images.image_runs(vlm_recipe(model={"max_pixels": 3136}).model)


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
@pytest.mark.parametrize(("vlm", "tokens"), [(VLMS[0], IMAGE_TOKENS), (VLMS[1], 10)])
def test_qlora_kit_data_shows_an_image_as_one_mark_with_its_size_and_tokens(vlm, tokens):
    """Gemma-3's run: two newlines, start of image, its 4 soft tokens, end of image, two newlines."""
    from qlora_kit.data.report import inspect_data

    recipe = vlm_recipe(model_path=vlm)
    view = inspect_data(recipe, images.image_runs(recipe.model).processor.tokenizer, count=2)
    for runs in view.examples:
        marks = [(text, trained) for text, trained in runs if text.startswith("[image")]
        assert marks == [(f"[image 56x56: {tokens} tokens]", False)]
        assert next(text for text, trained in runs if trained).endswith("<|im_end|>")
        assert not any("<start_of_image>" in text or "<image" in text for text, _ in runs)


def packed_examples(packed: dict, image_token: int) -> list[dict]:
    """A packed row's examples, each as a prepared row (its tokens, labels and images), in order."""
    from qlora_kit.data.packing import examples_of

    files = iter(packed["images"])
    out = []
    for example in examples_of(packed):
        count = sum(1 for a, b in itertools.pairwise([None, *example["input_ids"]]) if b == image_token != a)
        out.append({**example, "images": [next(files) for _ in range(count)]})
    return out


def rows_with_images_at_different_offsets(folder) -> str:
    """Chat rows whose image comes after 0, 2 and 4 words of text (a packed row's examples then
    hold their images at different positions of their own), with their images of three sizes (Qwen: 4, 6
    and 9 tokens); the file's path."""
    from PIL import Image

    rows = []
    for asked in (
        "Colour?",
        "Which colour?",
    ):  # twice each offset: the held-out share leaves each in training
        for index, colour in enumerate(["red", "blue", "green"]):
            Image.new("RGB", [(56, 56), (56, 84), (84, 84)][index], colour).save(folder / f"{colour}.png")
            lead = [{"type": "text", "text": " ".join(["look"] * 2 * index)}] if index else []
            question = [*lead, {"type": "image", "path": f"{colour}.png"}, {"type": "text", "text": asked}]
            answer = [{"type": "text", "text": colour}]
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": question},
                        {"role": "assistant", "content": answer},
                    ]
                }
            )
    write_rows(folder / "rows.jsonl", rows)
    return str(folder / "rows.jsonl")


@pytest.mark.slow  # runs the model
@pytest.mark.parametrize("vlm", [*VLMS, QWEN, QWEN3, QWEN3_MOE])
def test_packed_image_rows_give_every_example_its_own_loss(vlm, tmp_path, monkeypatch):
    """Rows whose images sit at different offsets, packed into one: through peft in training mode, each
    example's loss equals its loss alone on LLaVA (its own attention, positions and images), in float32
    where a leak between examples (0.3% of a loss here) stands out of the noise (bf16's is 0.1%).
    Qwen-VL's, its images of three sizes: each example's 3-D positions in the packed row are the model's
    get_rope_index of the example alone, and its loss its own.
    Gemma-3's packed examples leak through transformers' sliding-window mask (images.packing_refusal):
    measured here, so the refusal is lifted when transformers stops leaking; its image rows are padded,
    and data.packing: true is one line."""
    from qlora_kit.data import layout
    from qlora_kit.data.packing import pack_dataset
    from qlora_kit.errors import RecipeError
    from qlora_kit.training.batch_layout import resolve as _resolve_layout
    from qlora_kit.training.objectives.sft import prepare

    recipe = vlm_recipe(rows_with_images_at_different_offsets(tmp_path), model_path=vlm)
    runs = images.image_runs(recipe.model)
    tokenizer = runs.processor.tokenizer
    prepared = prepare_datasets(recipe.data, tokenizer, 0, runs=runs)
    offsets = [example["input_ids"].index(runs.marker_id) for example in prepared.train]
    rows = prepared.train.select([offsets.index(offset) for offset in sorted(set(offsets))])
    assert len(rows) == 3  # one row of each offset
    lm = adapters.attach_lora(model.load_base_model(recipe.model, recipe.quant), recipe.lora)
    lm.train()

    def losses(batch) -> list[float]:
        """Each example's summed loss, its examples found where the positions restart."""
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with torch.no_grad():
            logits = lm(**inputs).logits
        labels = batch["labels"][0, 1:]
        per_token = torch.nn.functional.cross_entropy(logits[0, :-1], labels, reduction="none")
        positions = batch.get("position_ids", torch.arange(len(labels) + 1)[None])
        positions = (positions[0] if positions.ndim == 3 else positions)[0].tolist()  # M-RoPE: the text row
        starts = [i for i, p in enumerate(positions) if p == 0] + [len(positions)]
        return [float(per_token[a : b - 1].sum()) for a, b in itertools.pairwise(starts)]

    padded = images.ImageCollator(build_collator(tokenizer, packing=False), runs)
    alone = sorted(losses(padded([row]))[0] for row in rows)
    packed_rows = pack_dataset(rows, recipe.data.max_seq_len * 3)
    assert len(packed_rows) == 1 and len(packed_rows[0]["images"]) == 3
    packed_batch = images.ImageCollator(build_collator(tokenizer, packing=True), runs)(packed_rows)
    together = sorted(losses(packed_batch))
    if runs.vision.mrope:  # each example's slice of the packed positions: the model's own, on it alone
        rope_index = lm.base_model.model.model.get_rope_index
        start = 0
        for row in (padded([row]) for row in packed_examples(packed_rows[0], runs.marker_id)):
            length = row["input_ids"].shape[1]
            theirs = rope_index(row["input_ids"], row["mm_token_type_ids"], row["image_grid_thw"])[0]
            assert torch.equal(packed_batch["position_ids"][1:, :, start : start + length], theirs)
            start += length
        # packed rows without images too: 1-D positions alone would build no packed mask (examples joined)
        text_only = {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, -100, 8], "position_ids": [0, 1, 0, 1]}
        positions = images.ImageCollator(build_collator(tokenizer, packing=True), runs)([text_only])
        assert positions["position_ids"][:, 0].tolist() == [[0, 1, 0, 1]] * 4
    refusal = images.packing_refusal(runs.vision, recipe.model.attn_implementation)
    assert (together == pytest.approx(alone, rel=1e-5)) == (refusal is None), (together, alone)

    offered = []
    choose = layout.choose_layout
    monkeypatch.setattr(
        layout, "choose_layout", lambda shares, allowed: offered.append(allowed) or choose(shares, allowed)
    )
    _resolve_layout(vlm_recipe(model_path=vlm, data={"packing": "auto"}), prepared, tokenizer, None, "no")
    assert offered == [layout.AUTO if refusal is None else ("padding", "group_by_length")]
    if refusal is not None:
        with pytest.raises(RecipeError, match=r"^data\.packing: Gemma3's image blocks are not kept apart"):
            prepare(vlm_recipe(model_path=vlm, data={"packing": True}), tokenizer)


@pytest.mark.slow  # prepares every image row
@pytest.mark.parametrize("vlm", VLMS)
def test_the_plan_counts_a_batchs_pixels_as_the_image_processor_makes_them(vlm):
    """The plan's image term against the pixels the family's image processor hands a batch: float32, and
    the vision tower's copy in the compute dtype (float32 here)."""
    from qlora_kit.memory.planner import plan

    recipe = vlm_recipe(model_path=vlm, train={"micro_batch_size": 4})
    runs = images.image_runs(recipe.model)
    prepared = prepare_datasets(recipe.data, runs.processor.tokenizer, 0, runs=runs)
    batch = images.ImageCollator(build_collator(runs.processor.tokenizer, packing=False), runs)(
        [prepared.train[i] for i in range(4)]
    )
    assert batch["pixel_values"].dtype == torch.float32
    assert plan(recipe, device="cpu").pixels == batch["pixel_values"].numel() * (4 + 4)


@pytest.mark.slow  # prepares every image row
def test_a_dynamic_resolution_plan_counts_the_datas_largest_images_or_max_pixels():
    """Qwen-VL's pixels are patches whose count follows each image's size: the plan of a batch of the
    data's largest (tall) images counts their patches as the image processor hands them, from the data's
    most image tokens in a row, and without the data from model.max_pixels (here the tall image's)."""
    from qlora_kit.memory.planner import plan

    recipe = vlm_recipe(model_path=QWEN, train={"micro_batch_size": 4})
    runs = images.image_runs(recipe.model)
    prepared = prepare_datasets(recipe.data, runs.processor.tokenizer, 0, runs=runs)
    largest = prepared.most_image_tokens_per_row()
    tall = [row for row in prepared.train if row["input_ids"].count(runs.marker_id) == largest][:4]
    batch = images.ImageCollator(build_collator(runs.processor.tokenizer, packing=False), runs)(tall)
    assert largest == 6 and len(tall) == 4
    held = batch["pixel_values"].numel() * (4 + 4)  # float32 pixels and the tower's float32 copy
    assert plan(recipe, device="cpu", image_tokens=largest).pixels == held
    bounded = vlm_recipe(model_path=QWEN, model={"max_pixels": 56 * 84}, train={"micro_batch_size": 4})
    assert plan(bounded, device="cpu").pixels == held


@pytest.mark.slow  # loads the model
def test_a_packed_run_is_evaluated_one_held_out_row_at_a_time():
    """With data.packing: true the validation rows are packed for training; eval asks each row's question
    with that row's images alone (a packed row's prompt with every example's images fails the model's
    image-count check)."""
    from qlora_kit.after.evaluate import evaluate

    results = evaluate(vlm_recipe(data={"packing": True, "max_seq_len": 256}), max_examples=3)
    assert results["exact_match_examples"] == 3 and results["tokens"] > 0
