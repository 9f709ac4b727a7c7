"""The private library methods the trainers override: each named with its reason, and a rename in
transformers or TRL met at import with one line, not by an override that silently stops being called."""

import pytest
from transformers import Trainer

from qlora_kit.training.objectives.dpo import GuardedDPOTrainer
from qlora_kit.training.objectives.grpo.grpo import GuardedGRPOTrainer
from qlora_kit.training.objectives.kto import GuardedKTOTrainer
from qlora_kit.training.step import private_hooks
from qlora_kit.training.step.trainer import GuardedTrainer

TRAINERS = [GuardedTrainer, GuardedDPOTrainer, GuardedGRPOTrainer, GuardedKTOTrainer]


@pytest.mark.parametrize("trainer", TRAINERS, ids=lambda cls: cls.__name__)
def test_every_private_library_method_a_trainer_overrides_is_named_with_its_reason(trainer):
    unnamed = private_hooks.overridden(trainer) - set(private_hooks.PRIVATE_OVERRIDES)
    assert not unnamed, f"{trainer.__name__} overrides private methods private_hooks.py does not name"
    assert {"_save_checkpoint", "_run_epoch"} <= private_hooks.overridden(trainer)


@pytest.mark.parametrize("name", ["_run_epoch", "_save_checkpoint", "_load_optimizer_and_scheduler"])
def test_a_renamed_private_trainer_method_fails_at_import_naming_it(monkeypatch, name):
    monkeypatch.delattr(Trainer, name)  # as a transformers release that renamed it
    with pytest.raises(ImportError, match=rf"\.{name} overrides a private method that .*Trainer"):
        private_hooks.checked(GuardedTrainer)


def test_a_renamed_private_trl_method_fails_at_import_naming_it(monkeypatch):
    from trl import GRPOTrainer

    monkeypatch.delattr(GRPOTrainer, "_generate_single_turn")
    with pytest.raises(
        ImportError, match=r"GuardedGRPOTrainer\._generate_single_turn .*seed_each_completion"
    ):
        private_hooks.checked(GuardedGRPOTrainer)
