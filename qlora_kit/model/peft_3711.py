"""Model stage: a narrow wrap of peft#3711, until a peft release carries its fix (peft PR #3715).

peft 0.21.2 reads the LoRA config of every transformers-5 mixture it maps to Qwen2-MoE's conversion pattern
(``transformers_weight_conversion``: deepseek_v3, glm4_moe, glm4_moe_lite, glm_moe_dsa, qwen3_next, and
others) as a transformers-4 checkpoint's: any target ending in ``.gate_proj``, ``.up_proj`` or
``.down_proj`` becomes the fused experts' ``target_parameters`` (at twice the rank), so the shared experts'
and the first dense layers' linears, real ``nn.Linear``s on transformers 5, get no LoRA, silently, and a
reload moves them again. https://github.com/huggingface/peft/issues/3711

``targets_kept(model)`` leaves peft's conversion out for one model, while peft attaches or loads its
adapter, where the conversion would move real linear layers' targets and the model was built by
transformers 5 (its config saved by transformers 5, or made here), not converted from a transformers-4
checkpoint; and on loading, it leaves out the renaming of the adapter's tensors where every one of them
already names a module of the model (the same bug's other half: transformers' checkpoint renamings, meant
for transformers-4 names, applied to an adapter saved on transformers 5; Laguna's shared experts lost
their tensors to it). Everywhere else peft converts as it does. tests/test_peft_3711.py turns red as soon as the
installed peft keeps these targets itself: then this module and its calls go.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from peft.utils import transformers_weight_conversion as conversion

from qlora_kit.model.layers import is_linear


def moved_linears(model) -> list[str]:
    """The linear layers of ``model`` (by leaf name) that peft's conversion would take for experts."""
    pattern = conversion._MODEL_TO_CONVERSION_PATTERN.get(getattr(model.config, "model_type", None))
    moved = conversion._MOE_TARGET_MODULE_MAPPING.get(pattern, {})
    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if is_linear(module)}
    return sorted(names & moved.keys())


def built_by_transformers_5(model) -> bool:
    """The model's config was written by transformers 5 (or made in this process), not a transformers-4
    checkpoint's, whose adapters peft's conversion is for."""
    version = getattr(model.config, "transformers_version", None)
    return version is None or not str(version).startswith(("3.", "4."))


def names_this_model(model, adapter_state_dict: dict) -> bool:
    """Every LoRA tensor of the adapter names a module ``model`` has: an adapter saved on transformers 5,
    which the transformers-4 renaming can only break (Laguna's ``mlp.shared_expert.`` pattern, a regex,
    also matches ``mlp.shared_experts`` and renames it to a layer that is not there)."""
    modules = {name for name, _ in model.named_modules()}
    lora = [key.split(".lora_")[0] for key in adapter_state_dict if ".lora_" in key]
    return bool(lora) and all(key in modules for key in lora)


@contextlib.contextmanager
def targets_kept(model) -> Iterator[None]:
    """peft attaches or loads adapters on ``model`` with its targets and tensors' names as written (the
    module docstring); a no-op for a model converted from a transformers-4 checkpoint."""
    if not built_by_transformers_5(model):
        yield
        return
    kept = model
    original_config = conversion.convert_peft_config_for_transformers
    original_state = conversion.convert_peft_adapter_state_dict_for_transformers
    moves = bool(moved_linears(model))

    def convert_config(peft_config, model, conversions):
        if not (moves and model is kept):
            original_config(peft_config, model, conversions)

    def convert_state(model, peft_config, adapter_state_dict, adapter_name="default"):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if base is kept and names_this_model(model, adapter_state_dict):
            return adapter_state_dict
        return original_state(
            model=model,
            peft_config=peft_config,
            adapter_state_dict=adapter_state_dict,
            adapter_name=adapter_name,
        )

    # peft imports these at each call (tuners_utils.inject_adapter, save_and_load.set_peft_model_state_dict),
    # so the module's names are the ones to replace for the duration
    conversion.convert_peft_config_for_transformers = convert_config
    conversion.convert_peft_adapter_state_dict_for_transformers = convert_state
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original_config
        conversion.convert_peft_adapter_state_dict_for_transformers = original_state
