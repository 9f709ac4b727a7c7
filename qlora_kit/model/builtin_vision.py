"""The builtin vision-language models: a tiny decoder (the builtin tokenizer, ``TINY_SHAPE``) behind a tiny
vision tower and projector, built from the families table's ``vision`` facet with a fixed seed and saved
with its processor (image processor, tokenizer with the image marker, chat template), then loaded back
through the ordinary loading code like any checkpoint. Nothing is downloaded.

``builtin:tiny-llava``: LLaVA's layout (a CLIP vision tower of 2 layers on 56 x 56 images in 14-pixel
patches, a two-layer projector, a Llama decoder of 4 layers): 17 image tokens an image.

``builtin:tiny-gemma3``: Gemma-3's (a SigLIP tower of 2 layers on the same images, its 16 patches pooled
to 4 soft tokens framed by start/end-of-image markers, a Gemma-3 decoder of 4 layers with sliding-window
layers): 10 tokens an image, the 4 soft tokens attending to each other both ways.

``builtin:tiny-qwen2.5-vl``: Qwen2.5-VL's (a tower of 2 layers, one of them windowed, on any image size in
14-pixel patches merged 2 x 2 into tokens, a Qwen2 decoder of 4 layers with M-RoPE): 4 tokens for a
56 x 56 image, 6 for 56 x 84, between <|vision_start|> and <|vision_end|>. Its processor has no video half
(model/vision.py: ``image_only_class``), so the build needs no torchvision.
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
    save_into_staging,
)
from qlora_kit.model.vision import image_only_class
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
BUILD_VERSION = 2


def ensure_tiny_vlm(name: str):
    """The folder of builtin vision-language model ``name``, built the first time."""
    import hashlib
    import json

    family = TINY_VISION_ARCHITECTURES[name]
    key = hashlib.sha256(
        json.dumps([BUILD_VERSION, name, TINY_SHAPE, family.tiny_config, repr(family.vision)]).encode()
    ).hexdigest()[:12]
    folder = cache_root() / "models" / f"{name}-{key}"
    if (folder / "config.json").exists():
        return folder
    return build_into(folder, lambda staging: _build(family, staging))


def _build(family, folder) -> None:
    vision = family.vision
    tokenizer = _tokenizer(vision, folder)
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
        **vision.tiny_model_config,
        **{key: tokenizer.convert_tokens_to_ids(token) for key, token in vision.token_ids.items()},
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
    image_processor = getattr(transformers, vision.image_processor_class)(**vision.tiny_image_processor)
    processor_class = (
        image_only_class(vision) if vision.video_processor else getattr(transformers, vision.processor_class)
    )
    processor = processor_class(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE.replace("IMAGE", vision.image_marker),
        **vision.tiny_processor,
    )
    save_into_staging(model, folder)
    processor.save_pretrained(folder)


def _tokenizer(vision, folder):
    """The builtin tokenizer with the family's image tokens; named ones (Gemma-3's ``boi_token``) become
    attributes the processor reads, through a reload (transformers sets them from ``extra_special_tokens``
    at load only)."""
    tokenizer = build_tokenizer()
    tokens = dict.fromkeys(
        [
            vision.expanded_token or vision.image_marker,
            *vision.named_tokens.values(),
            *vision.token_ids.values(),
        ]
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    if not vision.named_tokens:
        return tokenizer
    tokenizer.save_pretrained(folder)  # overwritten by the processor's save
    return transformers.AutoTokenizer.from_pretrained(folder, extra_special_tokens=dict(vision.named_tokens))
