"""train.compile: the Trainer compiles the model (accelerate, inductor) and trains it to the same losses."""

import pytest

from tests.conftest import quick_recipe

pytestmark = pytest.mark.slow  # compiling takes tens of seconds on 2 cores


def test_compiled_run_trains_to_the_losses_of_the_eager_run(tmp_path):
    from qlora_kit.training.pipeline import build

    losses = {}
    for compiled in (False, True):
        settings = {
            "train.compile": compiled,
            "train.max_steps": 3,
            "train.logging_steps": 1,
            "train.mixed_precision": "bf16",  # the GPU's path: autocast around the compiled forward
            "memory.checkpointing": "none",
            "memory.chunked_loss": False,
        }
        setup = build(quick_recipe(tmp_path / str(compiled), **settings))
        assert setup.trainer.args.torch_compile is compiled
        setup.trainer.train()
        assert hasattr(setup.trainer.model_wrapped, "_orig_mod") is compiled
        losses[compiled] = setup.trainer.metrics_log.rows
    eager = [row["loss"] for row in losses[False] if "loss" in row]
    compiled = [row["loss"] for row in losses[True] if "loss" in row]
    assert len(eager) == len(compiled) == 3
    assert compiled == pytest.approx(eager, rel=1e-3)
