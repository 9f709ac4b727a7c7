"""One training step, in the order it runs: each micro-batch's code, and the package's callbacks, which
act between the micro-batches and the optimizer step, attached here and nowhere else.

transformers' Trainer runs the loop (``Trainer._inner_training_loop``: accumulation, clipping, the
optimizer and the scheduler, evaluation, checkpoints, resume, DDP and FSDP through accelerate). Each
stage below names the function that does it and where it lives (paths under ``qlora_kit/``).

Before the first step (``train.probe_worst_batch``): ``SplitOnOom._run_epoch`` ->
``probe_worst_batch`` (training/step/oom_recovery.py) runs the longest micro-batch through 1 below and
discards its gradients, so an out-of-memory error is met (split, or stop) in the first minute.

One optimizer step:

0. the Trainer draws the step's micro-batches: ``SplitOnOom.get_batch_samples``
   (training/step/oom_recovery.py) keeps them and the random state, for a redo after an out-of-memory
   error. (GRPO: ``GrpoSplitOnOom`` samples each rollout first, training/objectives/grpo/oom.py, then
   hands its policy step to 1.)
1. per micro-batch, ``TrainingStep.training_step`` (here), in this order:

   a. its tokens counted, once however many parts or attempts: ``Throughput.count``
      (training/watch/throughput.py);
   b. its forward and backward passes, in ``parts`` chunks: ``SplitOnOom.train_in_parts``
      (training/step/oom_recovery.py) runs each chunk through transformers' ``Trainer.training_step``,
      which calls, per chunk:

      - the forward and loss: ``TrainingStep.compute_loss`` (here): ``MemoryMonitor.phase_started`` and
        ``forward_started`` (memory/monitor.py); the forward under ``SavedTensors.counting``
        (memory/accounting.py: the bytes saved for backward); the loss, the model's own or
        ``chunked_lm_loss`` (memory/loss_head.py); ``MemoryMonitor.forward_done``; and
        ``SplitOnOom.forward_done``, where several processes agree no one ran out of memory;
      - the backward: accelerate's ``backward`` (under DDP inside ``no_sync``, so that no process is
        left in an all-reduce when another runs out of memory);

      on an out-of-memory error, ``SplitOnOom._split_or_stop``: the step's micro-batches so far again
      in twice the parts, or a stop with one line, by the recipe's policy (training/step/oom_split.py:
      ``oom_policy``, the cut rows, the split file, the messages);
   c. the backward phase's peak: ``MemoryMonitor.backward_done`` (memory/monitor.py);
   d. its loss into the guard's device flag, no host read: ``TrainingGuard.record_loss``
      (training/step/guards.py).

2. after the last micro-batch: under DDP the gradients averaged in one all-reduce
   (``SplitOnOom._synchronise_gradients``, training/step/oom_recovery.py; FSDP reduces inside its
   backward), then the Trainer unscales (fp16) and clips;
3. ``on_pre_optimizer_step``: ``MemoryMonitor.on_pre_optimizer_step`` opens the optimizer's phase;
   ``TrainingGuard.on_pre_optimizer_step`` (training/step/guards.py) reads its flags once: a
   non-finite loss or gradient, or dead LoRA gradients, stop the run before the optimizer applies them;
4. the optimizer step (a GradScaler under fp16 skips overflow steps itself), then
   ``MemoryMonitor.on_optimizer_step`` (its peak and the device's used memory), then the scheduler;
5. ``on_step_end``: ``StopOnSignal.on_step_end`` (training/step/interrupts.py): a signal on any
   process -> a checkpoint and a stop, at the same step on all;
6. ``on_log``, when due, in ``callbacks``' order: ``MemoryMonitor.on_log``, ``Throughput.on_log``,
   ``ExpertLoad.on_log`` (training/watch/expert_load.py) add their figures to the logs;
   ``MetricsLog.on_log`` (training/watch/metrics_log.py), the trackers (training/watch/trackers.py)
   and, last, ``RunConsole.on_log`` (training/watch/run_console.py, ``show_on``) write them;
7. a checkpoint when due: ``GuardedTrainer._save_checkpoint`` (training/step/trainer.py) stages it
   with the split (``SplitOnOom.save_split``) and the costs auto chose by, then renames it into place
   (``move_into_place``, training/run_folder/outputs.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import ProgressCallback, TrainerCallback
from transformers.trainer_callback import PrinterCallback

from qlora_kit.memory import oom_faults
from qlora_kit.memory.accounting import SavedTensors
from qlora_kit.memory.loss_head import chunked_lm_loss
from qlora_kit.training.watch.run_console import RunConsole

if TYPE_CHECKING:
    from rich.console import Console

    from qlora_kit.memory.monitor import MemoryMonitor
    from qlora_kit.training.step.guards import TrainingGuard
    from qlora_kit.training.watch.metrics_log import MetricsLog
    from qlora_kit.training.watch.throughput import Throughput


class TrainingStep:
    """The micro-batch's code (the module docstring's item 1), before the out-of-memory split and the
    library's trainer in every trainer's class order (GRPO's rollouts come first: objectives/grpo/oom.py
    samples them, then hands each policy step to this ``training_step``).

    Set by ``GuardedTrainer``: ``throughput``, ``memory_monitor``, ``guard`` (None when measuring a run
    without it), ``chunk_tokens`` (the chunked loss head's, or None); ``train_in_parts`` and
    ``forward_done`` come from oom_recovery.py's ``SplitOnOom``."""

    counts_in_step = True  # the micro-batch's tokens are counted here (GRPO counts its rollouts instead)

    def training_step(self, model, inputs, num_items_in_batch=None):
        # a. its tokens, once however many parts or attempts, and not the worst-batch probe's
        if not self.probing and self.counts_in_step:
            self.throughput.count(inputs)
        # b. each part's forward (compute_loss) and backward through the Trainer's training_step; an
        #    out-of-memory error redoes the step's micro-batches so far in twice the parts
        loss = self.train_in_parts(model, inputs, num_items_in_batch)
        # c. the backward phase's peak, into the memory monitor
        self.memory_monitor.backward_done()
        # d. the loss into the guard's device flag, read once at on_pre_optimizer_step
        if self.guard is not None:
            self.guard.record_loss(loss)
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The forward pass and loss of one part (b above), with the bytes it saves for backward counted;
        an evaluation batch's under the evaluation's fault cap only."""
        if not model.training:
            with oom_faults.INJECTOR.evaluation():  # a no-op unless a test caps evaluation's memory
                return self._loss(model, inputs, return_outputs, num_items_in_batch)
        counter = SavedTensors(model, inject_faults=True)
        self.memory_monitor.phase_started()
        self.memory_monitor.forward_started()
        with counter.counting():
            result = self._loss(model, inputs, return_outputs, num_items_in_batch)
        self.memory_monitor.forward_done(counter.result())
        self.forward_done()  # out-of-memory in another process stops this one here too (oom_recovery.py)
        return result

    def _loss(self, model, inputs, return_outputs, num_items_in_batch):
        if self.chunk_tokens is None or return_outputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        causal_lm = self.accelerator.unwrap_model(model).get_base_model()
        loss = chunked_lm_loss(
            model,
            inputs,
            self.chunk_tokens,
            num_items_in_batch,
            causal_lm=causal_lm,
            autocast=self.accelerator.autocast,
        )
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            # Trainer.compute_loss scales the models' own loss the same way: num_items_in_batch is the
            # count over all processes, while DDP averages the gradients over processes.
            loss = loss * self.accelerator.num_processes
        return loss


def callbacks(
    monitor: MemoryMonitor,
    throughput: Throughput,
    routing: list[TrainerCallback],
    metrics_log: MetricsLog,
    guard: TrainingGuard | None,
    trackers: list[TrainerCallback],
    stopping: list[TrainerCallback],
    objective: list[TrainerCallback],
    callers: list[TrainerCallback],
) -> list[TrainerCallback]:
    """Every callback of a run, in the order the Trainer calls them: the memory monitor, the throughput
    and a mixture of experts' routing first (they add their figures to the logs the others write), the
    metrics file, the guard, the trackers, early stopping, the objective's own (GRPO's explanations), the
    caller's."""
    return [
        monitor,
        throughput,
        *routing,
        metrics_log,
        *([guard] if guard is not None else []),
        *trackers,
        *stopping,
        *objective,
        *callers,
    ]


def show_on(trainer, console: Console) -> TrainerCallback:
    """The run console in place of the Trainer's progress bars and printed log dicts (training/watch/run_console.py):
    the last callback, after every figure is in the logs."""
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    run_console = RunConsole(console)
    trainer.add_callback(run_console)
    return run_console
