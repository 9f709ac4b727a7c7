"""train.mixed_precision at the seam: what the Trainer and accelerate hold after ``pipeline.build``.

The resolution itself is tested per device in test_gpu_path.py; these tests read the far end of the
chain (recipe -> resolve_mixed_precision -> TrainingArguments -> accelerate), so a link that drops the
choice turns them red. Building sets a run up without training it.
"""

import pytest
import torch

from qlora_kit.training.pipeline import build

from .conftest import quick_recipe

# auto follows quant.compute_dtype (bfloat16 in the demo) on a GPU with native bf16, and is no on a CPU
AUTO = (
    "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False) else "no"
)


@pytest.mark.parametrize(("wanted", "expected"), [("no", "no"), ("bf16", "bf16"), ("auto", AUTO)])
def test_build_hands_the_resolved_precision_to_the_trainer_and_accelerate(wanted, expected, tmp_path):
    # train.compile false: auto would time eager steps and compile the layers to time them (nearly all of
    # a build's ~50 CPU s on a cold inductor cache), and no link of the precision's chain passes there
    recipe = quick_recipe(tmp_path, **{"train.mixed_precision": wanted, "train.compile": False})
    trainer = build(recipe).trainer
    assert trainer.args.bf16 is (expected == "bf16")
    assert trainer.args.fp16 is False
    assert trainer.accelerator.mixed_precision == expected
    assert trainer.accelerator.state.mixed_precision == expected


def test_dpo_build_hands_bf16_to_the_trainer_and_accelerate(tmp_path):
    from .e2e.test_dpo import dpo_recipe

    trainer = build(dpo_recipe(tmp_path / "out", **{"train.mixed_precision": "bf16"})).trainer
    assert trainer.args.bf16 is True and trainer.args.fp16 is False
    assert trainer.accelerator.mixed_precision == "bf16"
