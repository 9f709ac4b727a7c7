"""A vision-language batch's images, as the planner counts them: how many a row holds, and the bytes of
their pixels on the device for the whole step (memory/planner.py adds them to the peak). A fixed-size
family's images are its tower's size; a dynamic-resolution family's (Qwen-VL) are patches whose count
follows each image's size: the data's most image tokens in a row, else ``model.max_pixels``' bound."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qlora_kit.memory.shapes import DTYPE_BYTES
from qlora_kit.model import vision

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe


def images_in_a_row(recipe: Recipe, images_per_row: int | None) -> int:
    """The images a vision-language row holds: the data's most (a run plans with it, as ``plan
    --with-data`` does), else one an example, two examples a packed row (as the trace packs rows)."""
    return images_per_row or (2 if recipe.data.packs else 1)


def pixel_bytes(
    config, recipe: Recipe, rows: int, images_per_row: int | None = None, image_tokens: int | None = None
) -> int:
    """A vision-language batch's images on the device for the whole step: the image processor's float32
    pixels and the vision tower's copy in the compute dtype, at the tower's size; 0 for a text-only model."""
    facet = vision.vision_of(config) if config is not None else None
    if facet is None:
        return 0
    towers = config.vision_config
    images = rows * images_in_a_row(recipe, images_per_row)
    if facet.dynamic_resolution:
        values = rows * patches_in_a_row(config, recipe, images_per_row, image_tokens) * patch_values(towers)
    else:
        values = images * getattr(towers, "num_channels", 3) * towers.image_size**2
    return values * (4 + DTYPE_BYTES[recipe.quant.compute_dtype])


# transformers' Qwen2-VL image processor's bound when neither the model's processor nor the recipe says
DEFAULT_MAX_PIXELS = 28 * 28 * 1280


def patches_in_a_row(config, recipe: Recipe, images_per_row: int | None, image_tokens: int | None) -> int:
    """A dynamic-resolution row's vision patches (each image's 14-pixel patches; merged 2 x 2 into its
    tokens): the data's most image tokens in a row, else as many as ``model.max_pixels`` (or the
    processor's default) allows its images, and never more than the row's tokens hold."""
    merge = config.vision_config.spatial_merge_size**2
    if image_tokens is not None:
        return image_tokens * merge
    per_image = (recipe.model.max_pixels or DEFAULT_MAX_PIXELS) // config.vision_config.patch_size**2
    return min(images_in_a_row(recipe, images_per_row) * per_image, recipe.data.max_seq_len * merge)


def patch_values(towers) -> int:
    """Values of one patch as the image processor hands it: channels x frames x patch x patch."""
    return towers.in_channels * towers.temporal_patch_size * towers.patch_size**2
