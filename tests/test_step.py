"""One micro-batch's work reads in one class (issue 72): every objective's trainer runs its step through
``GuardedTrainer`` (training/step/trainer.py), which calls out-of-memory recovery, the throughput, the
memory monitor and the guard as objects; no qlora_kit mixin sits between it and the library's trainer."""

import inspect

import pytest
from transformers import Trainer

from qlora_kit.training.objectives.dpo import GuardedDPOTrainer
from qlora_kit.training.objectives.grpo.grpo import GuardedGRPOTrainer
from qlora_kit.training.objectives.kto import GuardedKTOTrainer
from qlora_kit.training.objectives.orpo import GuardedORPOTrainer
from qlora_kit.training.step import oom_recovery
from qlora_kit.training.step.trainer import GuardedTrainer

TRAINERS = [GuardedTrainer, GuardedDPOTrainer, GuardedORPOTrainer, GuardedKTOTrainer, GuardedGRPOTrainer]
# the Trainer methods a micro-batch's work runs through
STEP = ["get_batch_samples", "training_step", "compute_loss", "prediction_step", "_run_epoch"]


def _ours(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "qlora_kit"


def test_guarded_trainer_is_the_library_trainer_and_nothing_else():
    assert GuardedTrainer.__bases__ == (Trainer,)


@pytest.mark.parametrize("trainer", TRAINERS, ids=lambda cls: cls.__name__)
def test_each_step_method_is_the_objectives_own_or_guarded_trainers(trainer):
    # An objective's class may add to a step method (GRPO samples its rollouts first); anything else of
    # ours that defines one is a mixin a reader would have to open.
    for name in STEP:
        owners = [cls for cls in trainer.__mro__ if _ours(cls) and name in vars(cls)]
        assert set(owners) <= {trainer, GuardedTrainer}, f"{trainer.__name__}.{name} also in {owners}"
        assert GuardedTrainer in owners, f"GuardedTrainer.{name} is not on {trainer.__name__}'s path"


def test_oom_recovery_is_an_object_the_step_calls_not_a_base():
    for trainer in TRAINERS:
        assert not any(issubclass(cls, oom_recovery.OomRecovery) for cls in trainer.__mro__)
    # the step hands it the library's forward and backward: it never reaches the trainer's via super()
    assert "super()" not in inspect.getsource(oom_recovery.OomRecovery)
