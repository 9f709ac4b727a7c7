"""Vision-language models: which families are, how they load, and what LoRA leaves alone.

A vision-language family is a families-table entry with a ``vision`` facet (registries/families.py). Its
model loads through transformers' ``AutoModelForImageTextToText`` with the language model's linear layers
in 4 bits and, by default, the vision tower and the projector kept in ``quant.compute_dtype``
(``BitsAndBytesConfig``'s skip list): they are a small share of the weights (the 4-bit saving there is
small) and the part whose rounding the language model cannot correct, since LoRA trains the language
model only. ``quant.vision: true`` quantizes them too. LoRA's ``all-linear`` stops at the language model
(peft's ``exclude_modules``); ``lora.vision: true`` adapts the vision side as well.

The processor (image processor, tokenizer, chat template) is loaded by ``load_processor`` and saved with
the adapter, and is what the data stage hands images to (data/images.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qlora_kit.registries import families

if TYPE_CHECKING:
    from qlora_kit.registries.families import Vision


def vision_of(config) -> Vision | None:
    """The families table's vision facet for ``config`` (None: a text-only model)."""
    entry = families.family(getattr(config, "model_type", ""))
    return entry.vision if entry else None


def on_vision_side(name: str, vision: Vision | None) -> bool:
    """Whether module ``name`` sits under the vision tower or the projector of ``vision``'s model."""
    return vision is not None and any(f".{part}." in f".{name}." for part in vision.vision_modules)


def auto_class(config):
    """transformers' auto class that builds and loads ``config``'s model: a vision-language model's own,
    else the causal LM's."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if vision_of(config) else AutoModelForCausalLM


def skipped_modules(vision: Vision, quantize_vision: bool) -> list[str]:
    """Modules bitsandbytes leaves in 16 bits: the output head always, the vision side unless asked
    (transformers matches these from the start of a module's name, as regular expressions)."""
    return ["lm_head", *(() if quantize_vision else (rf"(?:.*\.)?{name}" for name in vision.vision_modules))]


def excluded_from_lora(model, vision_too: bool) -> str | None:
    """peft ``exclude_modules`` for a vision-language ``model`` (None for a text-only one, or when LoRA may
    adapt the vision side too): a pattern matching every module under the vision tower and the projector."""
    vision = vision_of(model.config)
    if vision is None or vision_too:
        return None
    return rf"(.*\.)?({'|'.join(vision.vision_modules)})(\..*)?"


def load_processor(
    path: str,
    trust_remote_code: bool = False,
    revision: str | None = None,
    vision: Vision | None = None,
    max_pixels: int | None = None,
):
    """The model folder's processor (image processor, tokenizer, chat template); ``max_pixels`` bounds a
    dynamic-resolution family's images (the processor's own bound when None). A family whose processor
    has a video half gets the image half alone where torchvision does not import (``image_only``)."""
    from transformers import AutoProcessor

    if vision is not None and vision.video_processor and not torchvision_imports():
        processor = image_only(vision, path, trust_remote_code, revision)
    else:
        processor = AutoProcessor.from_pretrained(
            path, trust_remote_code=trust_remote_code, revision=revision
        )
    if max_pixels is not None:
        size = processor.image_processor.size  # transformers' SizeDict, or a dict in older saves
        processor.image_processor.size = type(size)(**{**dict(size.items()), "longest_edge": max_pixels})
    return processor


def torchvision_imports() -> bool:
    """Whether torchvision imports here: transformers' video processors need it (the CPU wheels of some
    torch builds fail at import: ``operator torchvision::nms does not exist``)."""
    from transformers.utils import is_torchvision_available

    if not is_torchvision_available():
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:  # a wheel built for another torch raises RuntimeError at import
        return False
    return True


def image_only_class(vision: Vision):
    """transformers' processor class of ``vision`` without its video half: the same class but for an
    ``__init__`` that takes no video processor, so ProcessorMixin neither asks for one nor checks its class
    (which needs torchvision). It saves as transformers' own class, so the folder loads elsewhere."""
    import transformers

    base = getattr(transformers, vision.processor_class)

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__})


def image_only(vision: Vision, path: str, trust_remote_code: bool = False, revision: str | None = None):
    """``vision``'s processor made of the folder's slow (PIL) image processor, tokenizer and chat template."""
    import transformers

    options = {"trust_remote_code": trust_remote_code, "revision": revision}
    image_processor = getattr(transformers, vision.image_processor_class).from_pretrained(path, **options)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, **options)
    return image_only_class(vision)(image_processor, tokenizer, chat_template=tokenizer.chat_template)
