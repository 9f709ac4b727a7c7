"""``qlora-kit generate``: answers from a trained adapter, each prompt wrapped the way the recipe's data
format trained it (``model/generation.py`` does the decoding: greedy by default, sampling on request)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import TextStreamer

from qlora_kit.data import formats, images
from qlora_kit.errors import RecipeError
from qlora_kit.model import adapters
from qlora_kit.model.generation import Sampling, complete
from qlora_kit.model.modes import in_eval_mode

if TYPE_CHECKING:
    from qlora_kit.recipe.data import DataSection


def wrap_prompt(text: str, data: DataSection, tokenizer, history: list[dict[str, str]] | None = None) -> str:
    """The user's text as the model saw prompts in training (the format's own prompt, data/formats.py,
    with the recipe's system prompt)."""
    return formats.prompt(text, data.format, tokenizer, data, history)


def generate(
    adapter_dir: str | None,
    prompts: list[str],
    sampling: Sampling | None = None,
    raw: bool = False,
    recipe=None,
    stream: bool = False,
) -> list[str]:
    """Answers to ``prompts`` from the trained adapter (or from the recipe's base model when adapter_dir
    is None), each prompt wrapped as in training unless ``raw``."""
    recipe, tokenizer, lm = adapters.load_for_inference(adapter_dir, recipe)
    texts = [p if raw else wrap_prompt(p, recipe.data, tokenizer) for p in prompts]
    return [complete(lm, tokenizer, text, sampling, stream=stream) for text in texts]


def complete_with_images(
    lm,
    runs: images.ImageRuns,
    prompt: str,
    files: list[Path],
    sampling: Sampling | None = None,
    stream: bool = False,
) -> str:
    """A vision-language model's continuation of ``prompt`` (wrapped as training saw it, holding one image
    marker per file), each marker replaced by its image's run and the images' pixels beside them, as
    training fed them (data/images.py)."""
    tokenizer = runs.processor.tokenizer
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    try:
        expanded = images.expand({"input_ids": ids, "labels": ids}, files, runs)["input_ids"]
    except formats.RowError as exc:
        raise RecipeError(f"--image: {exc}") from None
    input_ids = torch.tensor([expanded], device=lm.device)
    beside = runs.model_inputs(input_ids, [images.open_image(f) for f in files])
    kwargs = (sampling or Sampling()).generate_kwargs()
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True) if stream else None
    with in_eval_mode(lm), torch.no_grad():
        output = lm.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pad_token_id=tokenizer.pad_token_id,
            streamer=streamer,
            **{k: v.to(lm.device) for k, v in beside.items()},
            **kwargs,
        )
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


def image_prompt(text: str, files: list[Path], runs: images.ImageRuns | None) -> str:
    """The user's text after one image marker per file (as the demo's rows put the image first); one line
    when the model takes no images or a file is missing."""
    if runs is None:
        raise RecipeError("--image: the adapter's base model is text-only (not a vision-language model)")
    for file in files:
        if not Path(file).is_file():
            raise RecipeError(f"--image: {file}: no such file")
    return runs.marker * len(files) + text
