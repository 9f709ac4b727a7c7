"""A multimodal checkpoint's language model, loaded alone (``families.LANGUAGE_MODEL_ALONE``: Gemma 4).

Gemma 4's released checkpoints are its vision(-and-audio)-language model: transformers' causal LM class for
their config is the whole multimodal model, towers included, while qlora_kit trains text. Its language
model is built here from the checkpoint's text config and its weights read under their own names (transformers'
``PrefixChange`` drops the ``language_model`` part, as transformers itself does for Qwen3.5); the towers'
weights are left unread. The planner plans the same model (``memory/shapes.py`` reads the text config too).

The adapter is written under the checkpoint's names (``model.language_model.layers.N...``) and its targets as
one regular expression that names the trained modules under either name (not the towers' layers of the same
names), so plain peft applies it to the model transformers builds from that checkpoint, as every other
tool's Gemma 4 adapter; qlora_kit's own commands read it back onto the language model alone through peft's
``key_mapping``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import weakref
from collections.abc import Iterator
from pathlib import Path

from qlora_kit.errors import RecipeError
from qlora_kit.registries import families

# each language model loaded alone -> the part of its weights' names the checkpoint adds (``language_model``)
_LOADED_ALONE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def alone(config) -> bool:
    return getattr(config, "model_type", None) in families.LANGUAGE_MODEL_ALONE


def language_model_config(config):
    """The config of the model qlora_kit builds for ``config``: its text config where the language model loads
    alone, with transformers told how that checkpoint names its weights; else ``config`` itself."""
    if not alone(config):
        return config
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import PrefixChange

    text_type, prefix = families.LANGUAGE_MODEL_ALONE[config.model_type]
    renaming = [PrefixChange(prefix_to_remove=prefix, model_prefix="model")]
    register_checkpoint_conversion_mapping(text_type, renaming, overwrite=True)
    return config.get_text_config()


@contextlib.contextmanager
def towers_left_unread() -> Iterator[None]:
    """transformers' load report lists every tower weight a language model leaves unread (hundreds of lines
    for a real checkpoint): left out until the block ends, its other warnings kept; ``check_loaded`` refuses
    a language model weight the load missed."""
    modeling = logging.getLogger("transformers.modeling_utils")  # logs the report (transformers 5.24)

    def not_the_report(record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()

    modeling.addFilter(not_the_report)
    try:
        yield
    finally:
        modeling.removeFilter(not_the_report)


def check_loaded(info: dict, path: str, model_type: str) -> None:
    """RecipeError in one line when the language model found no weights in the checkpoint for some of its
    own (``from_pretrained``'s loading info): they would train from random values."""
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise RecipeError(
            f"model.path: {path} holds no weights for {len(missing)} of {model_type}'s language model tensors "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        )


def mark_loaded_alone(base, checkpoint_config) -> None:
    """Remember that ``base`` is the language model of a multimodal checkpoint of ``checkpoint_config``."""
    _LOADED_ALONE[base] = families.LANGUAGE_MODEL_ALONE[checkpoint_config.model_type][1]


def _part(base) -> str | None:
    return _LOADED_ALONE.get(base)


def adapter_key_mapping(base) -> dict[str, str] | None:
    """peft's ``key_mapping`` that reads an adapter written under the checkpoint's names onto ``base`` (None
    for a model not loaded alone)."""
    part = _part(base)
    return None if part is None else {rf"^model\.{re.escape(part)}\.": "model."}


def write_as_checkpoint_names(peft_model, folder: str | Path) -> None:
    """Rewrite the adapter saved in ``folder`` under the multimodal checkpoint's names, where its base was
    loaded alone from one: each tensor's ``base_model.model.model.X`` as ``base_model.model.model.language_model.X``,
    and ``target_modules`` as a regular expression of the modules LoRA trained, each under its own name and
    under the checkpoint's (a layer index standing for any; the towers' layers, named alike, stay out)."""
    part = _part(peft_model.get_base_model())
    if part is None:
        return
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import load_file, save_file

    weights = Path(folder) / "adapter_model.safetensors"
    tensors = load_file(weights)
    inner = "base_model.model.model."
    renamed = {
        (f"{inner}{part}." + k.removeprefix(inner) if k.startswith(inner) else k): v
        for k, v in tensors.items()
    }
    save_file(renamed, weights, metadata={"format": "pt"})
    trained = {
        re.sub(r"layers\\\.\d+\\\.", r"layers\\.\\d+\\.", re.escape(name.removeprefix(inner)))
        for name, module in peft_model.named_modules()
        if isinstance(module, LoraLayer) and name.startswith(inner)
    }
    path = Path(folder) / "adapter_config.json"
    config = json.loads(path.read_text())
    config["target_modules"] = rf"model\.(?:{re.escape(part)}\.)?(?:{'|'.join(sorted(trained))})"
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
