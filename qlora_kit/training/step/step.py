"""One training step, in the order it runs: each micro-batch's code, and the package's callbacks, which
act between the micro-batches and the optimizer step, attached here and nowhere else.

transformers' Trainer runs the loop (``Trainer._inner_training_loop``: accumulation, clipping, the
optimizer and the scheduler, evaluation, checkpoints, resume, DDP and FSDP through accelerate). In it,
one optimizer step is:

1. per micro-batch, ``TrainingStep.training_step`` below: its tokens counted, its parts' forward and
   backward passes (one part unless an out-of-memory error split it), the backward phase closed in the
   memory monitor, its loss folded into the guard's device flag (no host read);
2. after the last micro-batch: DDP's all-reduce, then the Trainer unscales (fp16) and clips;
3. ``on_pre_optimizer_step``: the guard reads its flags once; a non-finite loss or gradient, or dead
   LoRA gradients, stop the run before the optimizer applies them (guards.py);
4. the optimizer step (a GradScaler under fp16 skips overflow steps itself), the scheduler;
5. ``on_log``: the memory monitor and the throughput add their figures to the logs, which the metrics
   file, the trackers and the run console then write (``callbacks`` gives that order);
6. a checkpoint when due, staged and renamed into place (trainer.py's ``_save_checkpoint``).
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
    library's trainer in every trainer's class order (GRPO's rollouts come first: grpo/oom.py samples
    them, then hands each policy step to this ``training_step``).

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
    """The run console in place of the Trainer's progress bars and printed log dicts (run_console.py):
    the last callback, after every figure is in the logs."""
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    run_console = RunConsole(console)
    trainer.add_callback(run_console)
    return run_console
