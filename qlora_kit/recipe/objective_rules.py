"""The rules ``train.objective`` sets across the recipe's sections: which data formats it trains on, which
sections apply to it, and what TRL's preference trainers (DPO's pairs, KTO's labelled answers) refuse.

Called by ``Recipe``'s validator (recipe.py), as each check there: a broken rule is a ``ValueError``
naming the field, which the recipe turns into one line.
"""

from __future__ import annotations

from qlora_kit.recipe.grpo import check_grpo
from qlora_kit.recipe.preference import PreferenceSection
from qlora_kit.registries import objectives
from qlora_kit.registries.formats import FORMATS
from qlora_kit.registries.objectives import OBJECTIVES


def check_objective(recipe) -> None:
    """The combinations train.objective, the data formats, the preference section and model.adapter allow
    (``recipe``: the whole Recipe, untyped here as in grpo.py: recipe.py imports this module)."""
    spec = objectives.of(recipe)
    own = {objectives.PAIRS, objectives.UNPAIRED}  # rows only their formats hold (FormatSpec.rows)
    # each source's own format (a mixture's sources name theirs; data.format is then only their default)
    by_field = recipe.data.formats_by_field()
    wrong = [(field, f) for field, f in by_field if FORMATS[f].rows != spec.rows]
    if spec.rows in own and wrong:
        fitting = " or ".join(n for n, fmt in FORMATS.items() if fmt.rows == spec.rows)
        field, fmt = wrong[0]
        raise ValueError(
            f"{field}: train.objective {spec.name} trains on {ROW_NOUNS[spec.rows]}: use {fitting} (got {fmt})"
        )
    held = [(field, f) for field, f in wrong if FORMATS[f].rows in own]
    if held:
        field, fmt = held[0]
        rows = FORMATS[fmt].rows
        by = " or ".join(n for n, s in OBJECTIVES.items() if s.rows == rows)
        raise ValueError(
            f"train.objective: format {fmt} holds {ROW_NOUNS[rows]}; set train.objective: {by} (set by {field})"
        )
    # from values: a saved recipe holds defaults
    if spec.section != "preference" and recipe.preference != PreferenceSection():
        applies = " or ".join(objectives.with_section("preference"))
        raise ValueError(f"preference: only applies to train.objective: {applies}")
    if spec.section == "preference":
        _check_preference(recipe, spec.name, spec.trainer)
    check_grpo(recipe)  # recipe/grpo.py


ROW_NOUNS = {objectives.PAIRS: "preference pairs", objectives.UNPAIRED: "answers labelled desirable or not"}


def _check_preference(recipe, name: str, trainer: str) -> None:
    """What TRL's preference trainers (DPO's pairs, KTO's labelled answers) refuse or do not do."""
    if recipe.data.packing is True:
        raise ValueError(f"data.packing: not with train.objective {name} (TRL pads its rows; it packs none)")
    if recipe.data.group_by_length:
        raise ValueError(
            f"data.group_by_length: not with train.objective {name} (TRL orders its rows itself)"
        )
    if recipe.lora.bias != "none":
        raise ValueError(
            f"lora.bias: {recipe.lora.bias} not with train.objective {name} (TRL's reference is a second adapter, "
            "and peft allows trained biases in one adapter only)"
        )
    if recipe.data.train_on_inputs:
        raise ValueError(f"data.train_on_inputs: not with train.objective {name} (it scores answers only)")
    if recipe.train.fsdp:
        raise ValueError(f"train.fsdp: not with train.objective {name} yet (untested under FSDP)")
    targets = recipe.lora.target_modules
    if isinstance(targets, list) and "lm_head" in targets:
        raise ValueError(f"lora.target_modules: TRL's {trainer} refuses LoRA on lm_head")
