"""One resolved run: what the recipe leaves to the machine, the data or the launch is resolved once, in
pipeline.build, and every later stage reads that object (training/resolved.py)."""

import re
from pathlib import Path

from qlora_kit.training.pipeline import build

from .conftest import quick_recipe

TRAINING = Path(__file__).resolve().parents[1] / "qlora_kit" / "training"
RESOLVERS = [
    "resolve_mixed_precision",
    "batch_layout.resolve",
    "resolve_layout",
    "resolve_auto",
    "launched_fsdp_settings",
]
# where each may be called: pipeline.build's checks and stages (resolved.py's ``as_given`` serves a
# Trainer built outside the pipeline); the layout's choice inside its stage, which pipeline.build calls
CALLERS = {"resolve_layout": {"batch_layout.py"}}


def test_the_training_stages_resolve_nothing_again():
    """Each resolver is called once in training/ (the layout's choice in its stage, batch_layout.py), by
    the stage that owns it."""
    calls = {}
    for path in TRAINING.rglob("*.py"):
        for name in RESOLVERS:
            for _ in re.finditer(
                rf"(?<!def )(?<![\w.]){re.escape(name)}\(|\.{re.escape(name)}\(", path.read_text()
            ):
                calls.setdefault(name, []).append(path.name)
    for name in RESOLVERS:
        callers = CALLERS.get(name, {"pipeline.py", "resolved.py"})
        assert calls.get(name), (name, calls)
        assert set(calls[name]) <= callers, (name, calls[name])
        assert all(calls[name].count(caller) <= 1 for caller in callers), (name, calls[name])


def test_a_built_run_carries_what_it_resolved_and_the_trainer_runs_it(tmp_path):
    settings = {
        "data.packing": "auto", "memory.checkpointing": "auto", "memory.budget_gb": 80,
        "train.mixed_precision": "bf16", "train.max_steps": 1,
        # packing auto times each layout on batches of this size: this test holds that the choice is
        # carried, not which it is (tests/test_layout.py), and 2 rows time 8 times faster than 16
        "train.micro_batch_size": 2,
    }  # fmt: skip
    setup = build(quick_recipe(tmp_path / "out", **settings))
    run = setup.run
    assert run.as_written.data.packing == "auto" and run.recipe.data.packing in (True, False)
    assert run.memory.checkpointing == "none" and run.recipe.memory.checkpointing == "auto"
    assert run.objective.name == "sft" and run.launch is None and run.output_dir == tmp_path / "out"
    args = setup.trainer.args
    assert (args.bf16, args.fp16) == (run.precision == "bf16", run.precision == "fp16")
    assert setup.trainer.layer_costs is run.layer_costs
    assert setup.checkpointed_layers == [], "everything fits 80 GiB: auto chose no checkpointing"
