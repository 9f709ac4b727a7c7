"""One training step, in the order it runs: ``GuardedTrainer``, the Trainer subclass every objective's
trainer builds on, whose ``training_step`` is a micro-batch's work as code.

transformers' Trainer runs the loop, and earns its place there: accumulation, clipping, the optimizer
and the scheduler, evaluation, checkpoints and resume, DDP and FSDP through accelerate, callbacks and
trackers, and TRL's DPO, KTO, ORPO and GRPO trainers are Trainers (they override ``compute_loss`` and
``training_step``, as this class does). What this class adds is called as objects, not inherited:
``self.oom`` (OomRecovery, oom_recovery.py), ``self.throughput`` (watch/throughput.py),
``self.memory_monitor`` (memory/monitor.py) and ``self.guard`` (guards.py). Paths below are under
``qlora_kit/``.

Before the first step (``train.probe_worst_batch``): ``_run_epoch`` -> ``probe_worst_batch`` runs the
longest micro-batch through 1 below, inside ``OomRecovery.probe_running``, and discards its gradients, so an out-of-memory error is
met (split, or stop) in the first minute.

One optimizer step:

0. the Trainer draws the step's micro-batches: ``get_batch_samples`` hands them to
   ``OomRecovery.step_started``, which keeps them and the random state for a redo after an
   out-of-memory error. (GRPO: its ``training_step`` samples each rollout first, then hands its policy
   step to 1: training/objectives/grpo/grpo.py.)
1. per micro-batch, ``training_step``:

   a. its tokens counted, once however many parts or attempts (``Throughput.count``);
   b. its forward and backward passes, in ``parts`` chunks: ``OomRecovery.train`` runs each chunk
      through ``_forward_backward`` (transformers' ``Trainer.training_step``), which calls, per chunk:

      - the forward and loss, ``compute_loss``: the memory monitor's phase opened; the forward under
        ``SavedTensors.counting`` (memory/accounting.py: the bytes saved for backward); the loss, the
        model's own or ``chunked_lm_loss`` (memory/loss_head.py); the monitor's ``forward_done``
        (several processes agree no one ran out of memory at the end of the model's forward pass and of
        each part's backward, in ``OomRecovery``: a hook it sets on the model under DDP, nothing here);
      - the backward: accelerate's ``backward`` (under DDP inside ``no_sync``, so that no process is
        left in an all-reduce when another runs out of memory);

      on an out-of-memory error, the step's micro-batches so far again in twice the parts, or a stop
      with one line, by the recipe's policy (oom/: ``policy.oom_policy``, the cut rows, the split file,
      the messages);
   c. the backward phase's peak: ``MemoryMonitor.backward_done``;
   d. its loss into the guard's device flag, no host read: ``TrainingGuard.record_loss``.

2. after the last micro-batch: under DDP the gradients averaged in one all-reduce (inside
   ``OomRecovery.train``; FSDP reduces inside its backward), then the Trainer unscales (fp16) and clips;
3. ``on_pre_optimizer_step``: the memory monitor opens the optimizer's phase; the guard reads its flags
   once: a non-finite loss or gradient, or dead LoRA gradients, stop the run before the optimizer
   applies them;
4. the optimizer step (a GradScaler under fp16 skips overflow steps itself), then
   ``MemoryMonitor.on_optimizer_step`` (its peak and the device's used memory), then the scheduler;
5. ``on_step_end``: ``StopOnSignal.on_step_end`` (interrupts.py): a signal on any process -> a
   checkpoint and a stop, at the same step on all;
6. ``on_log``, when due, in the order callbacks.py lists the callbacks: the figures added to the logs,
   then written (metrics file, trackers, the run console last);
7. a checkpoint when due: ``_save_checkpoint`` hands the library's save to ``StagedCheckpoints.save``
   (training/run_folder/checkpoints.py), which stages it, adds the split (``OomRecovery.save_split``) and
   the costs auto chose by, then renames it into place.

The private Trainer methods overridden here are named, with the reason no public hook serves, in
private_hooks.py, which checks at import that each still exists.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import Trainer
from transformers.trainer_pt_utils import LengthGroupedSampler

from qlora_kit.memory import layer_costs, layout_costs, optimizers
from qlora_kit.memory.accounting import SavedTensors
from qlora_kit.memory.loss_head import chunked_lm_loss
from qlora_kit.training.run_folder.checkpoints import StagedCheckpoints, save_final
from qlora_kit.training.step import private_hooks
from qlora_kit.training.step.oom.policy import OomPolicy
from qlora_kit.training.step.oom_recovery import OomRecovery

if TYPE_CHECKING:
    from qlora_kit.memory.monitor import MemoryMonitor
    from qlora_kit.training.step.guards import TrainingGuard
    from qlora_kit.training.watch.metrics_log import MetricsLog
    from qlora_kit.training.watch.throughput import Throughput

log = logging.getLogger(__name__)


@private_hooks.checked
class GuardedTrainer(Trainer):
    """The Trainer with qlora_kit's step, guards and memory accounting (see the module docstring).

    ``chunk_tokens``: tokens per chunk of the chunked loss head, or None for transformers' own loss;
    ``guard``: the training guard (None to measure a run without it); ``memory_monitor`` and
    ``metrics_log``: the callbacks that record the run, also passed in ``callbacks``; ``oom_policy``
    and ``probe``: what an out-of-memory error does, and whether the worst batch runs first.
    """

    oom_recovery = OomRecovery  # GRPO's splits its generation too (objectives/grpo/oom.py)
    counts_in_step = True  # the micro-batch's tokens are counted here (GRPO counts its rollouts instead)

    def __init__(
        self,
        *args,
        memory_monitor: MemoryMonitor,
        metrics_log: MetricsLog,
        throughput: Throughput,
        guard: TrainingGuard | None = None,
        chunk_tokens: int | None = None,
        optimizer_cls_and_kwargs: tuple | None = None,
        oom_policy: OomPolicy | None = None,
        probe: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        # Set here, not passed up: TRL's trainers do not take it (the Trainer only stores it)
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.memory_monitor = memory_monitor
        self.metrics_log = metrics_log
        self.throughput = throughput
        self.guard = guard
        self.chunk_tokens = chunk_tokens
        self.oom = self.oom_recovery(self, oom_policy or OomPolicy(), probe)
        self.repaged_tensors = 0  # optimizer state tensors put back into paged memory on resume
        self.layer_costs: layer_costs.LayerCosts | None = None  # checkpointing auto's (training/resolved.py)
        self.layout_costs: layout_costs.LayoutCosts | None = None  # data.packing auto's
        self.checkpoints = StagedCheckpoints()  # where a checkpoint is written while it is (run_folder/)

    # ---- one step (the module docstring's items 0 and 1) ------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.oom.step_started(batches)  # kept, with the random state, for a redo
        return batches, num_items

    def training_step(self, model, inputs, num_items_in_batch=None):
        # a. its tokens, once however many parts or attempts, and not the worst-batch probe's
        if not self.oom.probing and self.counts_in_step:
            self.throughput.count(inputs)
        # b. each part's forward (compute_loss) and backward; an out-of-memory error redoes the step's
        #    micro-batches so far in twice the parts
        loss = self.oom.train(model, inputs, num_items_in_batch, self._forward_backward)
        # c. the backward phase's peak, into the memory monitor
        self.memory_monitor.backward_done()
        # d. the loss into the guard's device flag, read once at on_pre_optimizer_step
        if self.guard is not None:
            self.guard.record_loss(loss)
        return loss

    def _forward_backward(self, model, part, num_items_in_batch):
        """One part's forward (``compute_loss``) and backward: the library trainer's own step."""
        return super().training_step(model, part, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The forward pass and loss of one part (b above), with the bytes it saves for backward counted;
        an evaluation batch's as the library computes it."""
        if not model.training:
            return self._loss(model, inputs, return_outputs, num_items_in_batch)
        counter = SavedTensors(model, step=True)
        self.memory_monitor.phase_started()
        self.memory_monitor.forward_started()
        with counter.counting():
            result = self._loss(model, inputs, return_outputs, num_items_in_batch)
        self.memory_monitor.forward_done(counter.result())
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

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        # evaluation's batch, split on an out-of-memory error as training's micro-batch is
        return self.oom.evaluate(model, inputs, prediction_loss_only, ignore_keys, super().prediction_step)

    def _run_epoch(self, model, epoch, *args, **kwargs):
        # Private (transformers is pinned <6): the first point where the model is prepared (DDP, FSDP,
        # autocast) and the optimizer built, before step 1's batches are drawn.
        if self.oom.probe_pending and self.state.global_step == 0:
            self.probe_worst_batch(model)
        self.oom.probe_pending = False
        return super()._run_epoch(model, epoch, *args, **kwargs)

    def probe_worst_batch(self, model) -> None:
        """Forward and backward on the micro-batch with the most tokens, and the largest evaluation batch
        under no-grad, through the step itself, then the gradients discarded and every random state put
        back (``OomRecovery.probe_running``): an out-of-memory error comes in the first minute, and is met
        as in training (split, or stop)."""
        args, sync = self.args, self.accelerator.sync_gradients
        with self.oom.probe_running():
            try:
                batch = self._worst_batch(self.train_dataset, args.per_device_train_batch_size)
                num_items = self._get_num_items_in_batch([batch], args.device)
                self.accelerator.gradient_state._set_sync_gradients(False)
                with self.accelerator.no_sync(model):  # nothing is reduced: the gradients are dropped
                    self.training_step(model, batch, num_items)
                model.zero_grad(set_to_none=True)
                if self.eval_dataset is not None and args.eval_strategy != "no":
                    batch = self._worst_batch(self.eval_dataset, args.per_device_eval_batch_size)
                    model.eval()
                    self.prediction_step(model, self._prepare_inputs(batch), prediction_loss_only=True)
                    model.train()
            finally:
                self.accelerator.gradient_state._set_sync_gradients(sync)
        log.info("worst-batch probe: the longest micro-batch fits (in %d part(s))", self.oom.parts)

    def _worst_batch(self, dataset, size: int) -> dict:
        # the tokenized datasets prepare.py builds (a datasets.Dataset with input_ids)
        lengths = np.array([len(ids) for ids in dataset["input_ids"]])
        longest = sorted(np.argsort(-lengths, kind="stable")[:size].tolist())
        rows = self._remove_unused_columns(dataset.select(longest), description="probe")
        return self.data_collator([rows[i] for i in range(len(rows))])

    # ---- checkpoints, the final save (run_folder/checkpoints.py), resume ---------------------------
    def _save_checkpoint(self, model, trial) -> None:
        # staged whole, then renamed into place; the library's own save writes it
        write = functools.partial(super()._save_checkpoint, model, trial)
        self.checkpoints.save(self.args, self.state, self.accelerator, write, self._add_to_checkpoint)

    def _add_to_checkpoint(self, checkpoint: Path) -> None:
        self.oom.save_split(checkpoint)  # the micro-batch split a --resume continues with
        if self.layer_costs is not None:  # and the costs auto chose its layers by
            layer_costs.write(checkpoint, self.layer_costs)
        if self.layout_costs is not None:  # and the figures auto chose its layout by
            layout_costs.write(checkpoint, self.layout_costs)

    def _get_output_dir(self, trial) -> str:
        return self.checkpoints.output_dir(super()._get_output_dir(trial))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        save_final(
            self.model,
            unwrapped,
            output_dir or self.args.output_dir,
            self.processing_class,
            self.is_fsdp_enabled,
            self.args.should_save,
        )

    def _get_train_sampler(self, train_dataset=None):
        # group_by_length: transformers' sampler draws each epoch's order from the global random state at
        # the epoch's start, which a resumed run reaches by another path (so it trained other batches);
        # the same order drawn from the seed and the epoch alone is one a resume reproduces.
        sampler = super()._get_train_sampler(train_dataset)
        if type(sampler) is LengthGroupedSampler:
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            return SeededLengthGroupedSampler(sampler.batch_size, lengths=sampler.lengths, seed=seed)
        return sampler

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # Overridden (a private method; transformers is pinned <6 for it) so a resumed paged optimizer
        # pages again: loading its state makes ordinary CUDA tensors of it (optimizers.repage_optimizer_state).
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.oom.load_split(Path(checkpoint))
            self.repaged_tensors = optimizers.repage_optimizer_state(self.optimizer)


class SeededLengthGroupedSampler(LengthGroupedSampler):
    """transformers' group_by_length order (similar lengths batched, the longest batch first), each epoch's
    drawn from ``seed + epoch``: the Trainer calls ``set_epoch`` before each epoch, a resumed one too (as
    accelerate's seedable sampler does for a shuffled order)."""

    def __init__(self, batch_size: int, lengths: list[int], seed: int) -> None:
        super().__init__(batch_size, lengths=lengths)
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        self.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return super().__iter__()
