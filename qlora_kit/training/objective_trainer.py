"""Training stage: ``train.objective`` -> its module, and the Trainer that runs it with qlora_kit's callbacks.

``MODULES`` imports each objective's module (training/objectives/), explicitly and on first use; its entry
in the objective table (registries/objectives.py) holds its traits. Each module builds its Trainer's
class and arguments: SFT runs on ``GuardedTrainer`` (objectives/sft.py, step/trainer.py), DPO on
``GuardedDPOTrainer`` (objectives/dpo.py, TRL's DPOTrainer under the same additions), GRPO on
``GuardedGRPOTrainer`` (objectives/grpo/grpo.py, TRL's GRPOTrainer, with the reward functions of
data/rewards.py and the explanations of grpo/explain.py), KTO on ``GuardedKTOTrainer`` (objectives/kto.py), ORPO on
``GuardedORPOTrainer`` (objectives/orpo.py).
All get the same callbacks, in the order that lets the memory and throughput figures reach every log
(step/callbacks.py).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from transformers import EarlyStoppingCallback

from qlora_kit.memory import fault_seam, optimizers
from qlora_kit.memory.loss_head import uses_chunked_loss
from qlora_kit.memory.monitor import MemoryMonitor
from qlora_kit.registries import objectives
from qlora_kit.training.step import callbacks as step_callbacks
from qlora_kit.training.step.arguments import pin_to_one_device
from qlora_kit.training.step.oom.policy import oom_policy, probes_worst_batch
from qlora_kit.training.step.trainer import GuardedTrainer
from qlora_kit.training.watch import expert_load
from qlora_kit.training.watch.expert_load import ExpertLoad
from qlora_kit.training.watch.metrics_log import MetricsLog
from qlora_kit.training.watch.throughput import Throughput, peak_tflops
from qlora_kit.training.watch.trackers import tracker_callbacks

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe
    from qlora_kit.training.resolved import ResolvedRun


def _sft() -> ModuleType:
    from qlora_kit.training.objectives import sft

    return sft


def _dpo() -> ModuleType:
    from qlora_kit.training.objectives import dpo

    return dpo


def _orpo() -> ModuleType:
    from qlora_kit.training.objectives import orpo

    return orpo


def _grpo() -> ModuleType:
    from qlora_kit.training.objectives.grpo import grpo

    return grpo


def _kto() -> ModuleType:
    from qlora_kit.training.objectives import kto

    return kto


# train.objective -> the module that builds its data, arguments and Trainer, imported when a run asks for
# it (TRL loads only for the objectives that run on it). The objective table cannot name the module
# itself: it is standard library only, read by the recipe, which sits below training.
MODULES: dict[str, Callable[[], ModuleType]] = {
    "sft": _sft,
    "dpo": _dpo,
    "orpo": _orpo,
    "grpo": _grpo,
    "kto": _kto,
}


def builder(recipe: Recipe) -> ModuleType:
    """The module that builds ``train.objective``'s data, arguments and Trainer."""
    return MODULES[objectives.of(recipe).name]()


def build_trainer(
    run: ResolvedRun,
    peft_model,
    tokenizer,
    train_set,
    val_set,
    callbacks: list | None = None,
    guards: bool = True,
) -> GuardedTrainer:
    """The run's Trainer, as resolved (resolved.py). ``guards=False`` leaves out the loss and gradient
    guards (benchmarks/guards.py measures their cost)."""
    recipe, output_dir = run.recipe, run.output_dir
    has_eval = val_set is not None
    # the objective's own module builds its Trainer's class, arguments and extras (TRL loads only for
    # the objectives that run on it)
    trainer_class, args, guard_class, extra = MODULES[run.objective.name]().trainer_parts(
        recipe, tokenizer, output_dir, has_eval, run.precision
    )
    objective_callbacks = extra.pop("callbacks", [])
    pin_to_one_device(args)
    guard = guard_class(peft_model) if guards else None
    metrics_log = MetricsLog(output_dir / "metrics.jsonl")
    monitor = MemoryMonitor()
    throughput = Throughput(peft_model, peak_tflops(recipe.train.peak_tflops))
    # DPO: TRL's head computes the answers' log-probabilities without whole logits already
    chunked = uses_chunked_loss(recipe, peft_model.get_base_model().config)
    patience = recipe.train.early_stopping_patience
    stopping = [EarlyStoppingCallback(early_stopping_patience=patience)] if patience else []
    trainer = trainer_class(
        model=peft_model,
        args=args,
        train_dataset=train_set,
        eval_dataset=val_set if args.eval_strategy != "no" else None,
        **extra,  # grpo: the reward functions (TRL collates nothing)
        processing_class=tokenizer,
        optimizer_cls_and_kwargs=optimizers.optimizer_class_and_kwargs(recipe.optimizer),
        callbacks=step_callbacks.callbacks(
            monitor,
            throughput,
            [ExpertLoad(peft_model, metrics_log)] if expert_load.routers(peft_model)[0] else [],
            metrics_log,
            guard,
            trackers=tracker_callbacks(run.as_written, output_dir),
            stopping=stopping,
            objective=objective_callbacks,
            callers=callbacks or [],
        ),
        memory_monitor=monitor,
        metrics_log=metrics_log,
        throughput=throughput,
        guard=guard,
        chunk_tokens=recipe.memory.loss_chunk_tokens if chunked else None,
        oom_policy=oom_policy(recipe),
        probe=probes_worst_batch(recipe),
    )
    fault_seam.trainer_built(trainer)  # nothing happens unless a test installed faults
    trainer.layer_costs = run.layer_costs  # into every checkpoint, for --resume
    trainer.layout_costs = run.layout_costs
    return trainer
