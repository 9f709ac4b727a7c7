"""One micro-batch's work reads in one class (issue 72): every objective's trainer runs its step through
``GuardedTrainer`` (training/step/trainer.py), which calls out-of-memory recovery, the throughput, the
memory monitor and the guard as objects; no qlora_kit mixin sits between it and the library's trainer."""

import ast
import inspect
import pickle
import textwrap

import pytest
from transformers import Trainer
from trl import DPOTrainer, KTOTrainer

from qlora_kit.memory.monitor import MemoryMonitor
from qlora_kit.training.objectives.dpo import GuardedDPOTrainer
from qlora_kit.training.objectives.grpo.grpo import GuardedGRPOTrainer
from qlora_kit.training.objectives.grpo.oom import GrpoOomRecovery
from qlora_kit.training.objectives.kto import GuardedKTOTrainer
from qlora_kit.training.objectives.orpo import GuardedORPOTrainer
from qlora_kit.training.step import oom_recovery
from qlora_kit.training.step.guards import TrainingGuard
from qlora_kit.training.step.trainer import GuardedTrainer
from qlora_kit.training.watch.throughput import Throughput

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


# The objects the step calls (GuardedTrainer's module docstring): they run the work they are handed
CALLED = [oom_recovery.OomRecovery, GrpoOomRecovery, Throughput, MemoryMonitor, TrainingGuard]


def trainer_methods_named(cls: type) -> list[str]:
    """The trainers' methods ``cls`` reaches by name through a trainer it holds (``self.trainer.X``,
    ``trainer.X``): a call back into the class that called it."""
    methods = {
        name
        for trainer in TRAINERS
        for name, value in inspect.getmembers(trainer)
        if inspect.isfunction(value) or inspect.ismethod(value)
    }
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    named = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or node.attr not in methods:
            continue
        held = node.value
        if (isinstance(held, ast.Name) and held.id == "trainer") or (
            isinstance(held, ast.Attribute) and held.attr == "trainer"
        ):
            named.append(f"{cls.__name__}:{node.lineno} trainer.{node.attr}")
    return named


@pytest.mark.parametrize("called", CALLED, ids=lambda cls: cls.__name__)
def test_no_object_the_step_calls_calls_back_into_the_trainer_by_name(called):
    """The step runs one way: the trainer calls these with the work to do (``OomRecovery.train``'s
    ``forward_backward``, ``evaluate``'s ``predict``); the worst-batch probe is the trainer's own method,
    inside ``OomRecovery.probe_running``."""
    assert trainer_methods_named(called) == []


def test_the_call_back_check_sees_a_trainer_method_named(monkeypatch):
    class Recovery:
        def __init__(self, trainer):
            self.trainer = trainer

        def probe(self, model, batch):
            trainer = self.trainer
            trainer.training_step(model, batch)
            return self.trainer.prediction_step(model, batch, True), self.trainer.args

    assert trainer_methods_named(Recovery) == [
        "Recovery:7 trainer.training_step",
        "Recovery:8 trainer.prediction_step",
    ]


@pytest.mark.parametrize(
    ("trainer", "library"), [(GuardedDPOTrainer, DPOTrainer), (GuardedKTOTrainer, KTOTrainer)]
)
def test_dpo_and_kto_are_the_guarded_trainer_on_trls_and_take_the_reference_over_in_init(trainer, library):
    """No mixin first: a reader follows the class, its two bases, and ``__init__``'s call of
    reference_adapter.take_over_reference."""
    assert trainer.__bases__ == (GuardedTrainer, library)
    assert "take_over_reference(self.model)" in inspect.getsource(trainer.__init__)
    assert pickle.loads(pickle.dumps(trainer)) is trainer  # found by its name in its module


def test_dpo_and_kto_share_one_function_for_what_they_add():
    """What DPO's and KTO's trainers add to GuardedTrainer is written once
    (reference_adapter.reference_trainer): their methods are the same code, and DPO's only own method
    skips TRL's tokenizing."""
    for name in ("__init__", "_send_telemetry", "reference_description"):
        assert vars(GuardedDPOTrainer)[name].__code__ is vars(GuardedKTOTrainer)[name].__code__, name
    assert set(vars(GuardedDPOTrainer)) - set(vars(GuardedKTOTrainer)) == {"_prepare_dataset"}
