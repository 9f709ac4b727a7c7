"""The Trainer subclass and its construction from a recipe: arguments, optimizer, collator, callbacks.

transformers' Trainer runs the loop (accumulation, clipping, scheduling, evaluation, logging,
checkpoints, resume, DDP/FSDP through accelerate). ``GuardedTrainer`` adds what it has not, and one
optimizer step runs in this order (``Trainer._inner_training_loop``, transformers 5.24):

1. per micro-batch: ``training_step`` counts its tokens (throughput), then per part of it (one, unless
   an out-of-memory error split it: oom_recovery.py) ``compute_loss`` — the forward pass (under
   accelerate's autocast) with transformers' loss or the chunked loss head (memory/loss_head.py),
   while ``SavedTensors`` counts the bytes saved for backward;
2. ``training_step`` — backward; then the micro-batch's loss is folded into the guard's device flag
   (no host read; under train.objective dpo TRL's loss reads its reward metrics on the host each
   micro-batch) and the monitor closes the backward phase;
3. after the last micro-batch: DDP's all-reduce, then the Trainer unscales (fp16) and clips;
4. ``on_pre_optimizer_step`` — the guard reads its flags once: a non-finite loss or gradient stops the
   run here, before the optimizer applies it; dead LoRA gradients stop it too (guards.py);
5. the optimizer step (with a GradScaler under fp16, which skips overflow steps itself), the scheduler;
6. logging (``MemoryMonitor`` and ``Throughput`` add their figures to the logs ``MetricsLog`` and
   the trackers write: trackers.py);
7. a checkpoint when due: ``_save_checkpoint`` stages it and renames it into place.

Private Trainer methods overridden, each safe because ``transformers<6`` is pinned (pyproject.toml):
``_save_checkpoint`` and ``_get_output_dir`` (atomic checkpoints), ``_load_optimizer_and_scheduler``
(a resumed paged optimizer pages again, the micro-batch split is read back), ``_run_epoch`` (the
worst-batch probe, oom_recovery.py); ``save_model`` (public) writes the adapter as the final save does, gathered under FSDP.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import Trainer, TrainingArguments
from transformers.training_args import ParallelMode

from qlora_kit.memory import layer_costs, oom_faults, optimizers
from qlora_kit.memory.accounting import SavedTensors
from qlora_kit.memory.loss_head import chunked_lm_loss
from qlora_kit.memory.monitor import MemoryMonitor, MetricsLog
from qlora_kit.model import adapters
from qlora_kit.training.guards import TrainingGuard
from qlora_kit.training.micro_batches import OomPolicy
from qlora_kit.training.oom_recovery import SplitOnOom
from qlora_kit.training.outputs import move_into_place, staging_dir
from qlora_kit.training.throughput import Throughput

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)

SCHEDULES = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}


def training_arguments(recipe: Recipe, output_dir: Path, has_eval: bool, precision: str):
    """The Trainer's arguments; ``precision`` is the resolved mixed precision (bf16, fp16 or no)."""
    return TrainingArguments(**training_settings(recipe, output_dir, has_eval, precision))


def training_settings(recipe: Recipe, output_dir: Path, has_eval: bool, precision: str) -> dict[str, Any]:
    """TrainingArguments' fields from the recipe (also the base of TRL's DPOConfig: dpo.py)."""
    train, opt = recipe.train, recipe.optimizer
    evaluating = has_eval and train.eval_steps is not None
    return dict(
        output_dir=str(output_dir),
        num_train_epochs=train.epochs,
        max_steps=train.max_steps or -1,
        per_device_train_batch_size=train.micro_batch_size,
        per_device_eval_batch_size=train.micro_batch_size,
        gradient_accumulation_steps=train.grad_accum,
        learning_rate=opt.lr,
        lr_scheduler_type=SCHEDULES[opt.schedule],
        warmup_steps=opt.warmup_ratio,  # a float below 1 is a fraction of the total steps
        weight_decay=opt.weight_decay,
        max_grad_norm=opt.max_grad_norm,
        logging_steps=train.logging_steps,
        eval_strategy="steps" if evaluating else "no",
        eval_steps=train.eval_steps,
        eval_on_start=evaluating,  # the baseline every later evaluation is compared with
        save_strategy="steps" if train.save_steps else "no",
        save_steps=train.save_steps or 500,
        train_sampling_strategy="group_by_length" if recipe.data.group_by_length else "random",
        seed=train.seed,
        data_seed=train.seed,
        # accelerate's autocast and fp32 output conversion, on a CPU as on a GPU (precision.py)
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        # accelerate compiles the model when it prepares it (benchmarks/results/compile-cpu.md: same losses,
        # 0.65-0.70x the step time after compiling, with checkpointing and the chunked loss head too)
        torch_compile=train.compile,
        # The Trainer's default for a PeftModel is True: a graph walk every step, and with LoRA on
        # lm_head under the chunked loss head (applied outside the forward) a crash. Every LoRA
        # parameter gets a gradient each step, so DDP needs no search.
        ddp_find_unused_parameters=False,
        # Its check reads the loss on the host after every micro-batch (a GPU sync); the loss guard
        # already stops a run at a non-finite loss, before anything is logged (guards.py).
        logging_nan_inf_filter=False,
        label_names=["labels"],  # peft's wrapper hides the signature the Trainer infers this from
        # train.keep_best: the Trainer tracks the best evaluation and loads its checkpoint at the end
        # (early stopping compares the same metric); lower is better for a name ending in "loss"
        load_best_model_at_end=train.keep_best is not None,
        metric_for_best_model=train.keep_best or ("eval_loss" if train.early_stopping_patience else None),
        report_to="none",  # the trackers are attached in build_trainer, after qlora_kit's callbacks (trackers.py)
        run_name=train.run_name or Path(output_dir).name,
        project=train.project,
        dataloader_pin_memory=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
    )


def pin_to_one_device(args) -> None:
    """One process sees several GPUs: train on the first, as the recipe's batch says.

    The Trainer would multiply the batch by every visible GPU (``n_gpu``) while the 4-bit model sits on
    GPU 0 alone (bitsandbytes models are never wrapped in DataParallel): a bigger batch than the
    recipe's and an OOM risk. transformers does the same for model-parallel models (Trainer.__init__).
    """

    if args.n_gpu > 1 and args.parallel_mode == ParallelMode.NOT_DISTRIBUTED:
        log.warning(
            "%d GPUs visible to one process: training on GPU 0 only. For all of them, launch one process "
            "per GPU: accelerate launch --num_processes %d -m qlora_kit train RECIPE",
            args.n_gpu,
            args.n_gpu,
        )
        args._n_gpu = 1


class GuardedTrainer(SplitOnOom, Trainer):
    """The Trainer with qlora_kit's loss head, guards and memory accounting (see the module docstring).

    ``chunk_tokens``: tokens per chunk of the chunked loss head, or None for transformers' own loss;
    ``guard``: the training guard (None to measure a run without it); ``memory_monitor`` and
    ``metrics_log``: the callbacks that record the run, also passed in ``callbacks``; ``oom_policy``
    and ``probe``: what an out-of-memory error does, and whether the worst batch runs first (oom_recovery.py).
    """

    counts_in_step = True  # training_step counts its micro-batch's tokens (GRPO counts its rollouts instead)

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
        self.setup_oom(oom_policy or OomPolicy(), probe)
        # Set here, not passed up: TRL's trainers do not take it (the Trainer only stores it)
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.memory_monitor = memory_monitor
        self.metrics_log = metrics_log
        self.throughput = throughput
        self.guard = guard
        self.chunk_tokens = chunk_tokens
        self.repaged_tensors = 0  # optimizer state tensors put back into paged memory on resume
        self.layer_costs: layer_costs.LayerCosts | None = None  # what checkpointing auto measured (pipeline)
        self._staging: Path | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
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

    def _save_checkpoint(self, model, trial) -> None:
        # Write the whole checkpoint under .staging/, then rename it into place: a kill mid-save leaves
        # the previous checkpoint as the newest complete one, never a half-written one. Every rank writes
        # its part (RNG states) into the same staging folder; the main process moves it once all are done.
        output_dir = Path(self.args.output_dir)
        self._staging = staging_dir(output_dir, name=f"step-{self.state.global_step}")
        try:
            super()._save_checkpoint(model, trial)
        finally:
            staged, self._staging = self._staging, None
        if self.args.should_save:  # the micro-batch split a --resume continues with
            self.save_split(staged / f"checkpoint-{self.state.global_step}")
        if self.args.should_save and self.layer_costs is not None:  # and the costs auto chose its layers by
            layer_costs.write(staged / f"checkpoint-{self.state.global_step}", self.layer_costs)
        self._record_best_where_it_will_be(staged, output_dir)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:
            for checkpoint in staged.glob("checkpoint-*"):
                move_into_place(checkpoint, output_dir / checkpoint.name)
            shutil.rmtree(staged, ignore_errors=True)
        self.accelerator.wait_for_everyone()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        # The adapter and tokenizer, as the final folder holds them (adapters.save_adapter). Replaces the
        # Trainer's: under FSDP it writes a model only with FULL_STATE_DICT, and then gathers the whole
        # model, 4-bit base included, onto one process. Here every rank gathers the adapter alone. (The
        # sharded adapter and optimizer state the Trainer resumes from are written beside it.)
        output_dir = output_dir or self.args.output_dir
        adapter = adapters.full_adapter_state(self.model) if self.is_fsdp_enabled else None
        if self.args.should_save:
            adapters.save_adapter(
                self.accelerator.unwrap_model(self.model, keep_torch_compile=False), output_dir, adapter
            )
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)

    def _record_best_where_it_will_be(self, staged: Path, output_dir: Path) -> None:
        # The Trainer records the best checkpoint as the folder it has just written, here under .staging/:
        # record where it is moved to, in the state and in the checkpoint's trainer_state.json (a resume
        # reads it from there, and would drop a path that no longer exists).
        best = self.state.best_global_step
        if not best or self.state.best_model_checkpoint is None:
            return
        final = output_dir / f"checkpoint-{best}"
        if Path(self.state.best_model_checkpoint) == final:
            return
        self.state.best_model_checkpoint = str(final)
        if self.args.should_save:
            self.state.save_to_json(
                str(staged / f"checkpoint-{self.state.global_step}" / "trainer_state.json")
            )

    def _get_output_dir(self, trial) -> str:
        return str(self._staging) if self._staging is not None else super()._get_output_dir(trial)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # Overridden (a private method; transformers is pinned <6 for it) so a resumed paged optimizer
        # pages again: loading its state makes ordinary CUDA tensors of it (optimizers.repage_optimizer_state).
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.load_split(Path(checkpoint))
            self.repaged_tensors = optimizers.repage_optimizer_state(self.optimizer)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if not self.probing and self.counts_in_step:  # once per micro-batch, however many parts or attempts
            self.throughput.count(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.memory_monitor.backward_done()
        if self.guard is not None:
            self.guard.record_loss(loss)
        return loss
