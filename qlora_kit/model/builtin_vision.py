"""The builtin vision-language models: a tiny decoder (the builtin tokenizer, ``TINY_SHAPE``) behind a tiny
vision tower and projector, built from the families table's ``vision`` facet with a fixed seed and saved
with its processor (image processor, tokenizer with the image marker, chat template), then loaded back
through the ordinary loading code like any checkpoint. Nothing is downloaded.

``builtin:tiny-llava``: LLaVA's layout (a CLIP vision tower of 2 layers on 56 x 56 images in 14-pixel
patches, a two-layer projector, a Llama decoder of 4 layers): 17 image tokens an image.
"""

from __future__ import annotations

import torch
import transformers

from qlora_kit.model.builtin import (
    LM_HEAD_SCALE,
    TINY_SHAPE,
    build_into,
    build_tokenizer,
    cache_root,
)
from qlora_kit.registries.families import FAMILIES

# The chat template the builtin VLMs ship: the builtin's ChatML with image parts, {% generation %} marking
# the assistant's text (the masks are derived from the rendering either way: data/chat.py).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{% set parts = [{'type': 'text', 'text': m['content']}] %}"
    "{% else %}{% set parts = m['content'] %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{% for p in parts %}{{ p['text'] }}{% endfor %}"
    "<|im_end|>{% endgeneration %}"
    "{% else %}{% for p in parts %}{% if p['type'] == 'image' %}IMAGE{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_VISION_ARCHITECTURES = {f.tiny: f for f in FAMILIES.values() if f.vision}
BUILD_VERSION = 1


def ensure_tiny_vlm(name: str):
    """The folder of builtin vision-language model ``name``, built the first time."""
    import hashlib
    import json

    family = TINY_VISION_ARCHITECTURES[name]
    key = hashlib.sha256(
        json.dumps(
            [BUILD_VERSION, name, TINY_SHAPE, family.tiny_config, family.vision.tiny_vision_config]
        ).encode()
    ).hexdigest()[:12]
    folder = cache_root() / "models" / f"{name}-{key}"
    if (folder / "config.json").exists():
        return folder
    return build_into(folder, lambda staging: _build(family, staging))


def _build(family, folder) -> None:
    vision = family.vision
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [vision.image_marker]})
    text = {
        **TINY_SHAPE,
        **family.tiny_config,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = getattr(transformers, family.config_class)(
        text_config=text,
        vision_config=dict(vision.tiny_vision_config),
        image_token_id=tokenizer.convert_tokens_to_ids(vision.image_marker),
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng():  # a fixed seed without disturbing the caller's random stream
        torch.manual_seed(0)
        model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # as the text builtins: a head wide enough for confident answers (builtin.py)
        model.get_output_embeddings().weight.mul_(LM_HEAD_SCALE)
    model.generation_config.eos_token_id = [
        tokenizer.eos_token_id,
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    side = vision.tiny_vision_config["image_size"]
    image_processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side}
    )
    processor = getattr(transformers, vision.processor_class)(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE.replace("IMAGE", vision.image_marker),
        patch_size=vision.tiny_vision_config["patch_size"],
        vision_feature_select_strategy="full",
        num_additional_image_tokens=1,  # CLIP's class token, which "full" keeps
        image_token=vision.image_marker,
    )
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
