"""The Trainer subclass and its construction from a recipe: arguments, optimizer, collator.

transformers' Trainer runs the loop (accumulation, clipping, scheduling, evaluation, logging,
checkpoints, resume, DDP/FSDP through accelerate). ``GuardedTrainer`` adds what it has not: the step's
order (step.py: the micro-batch's code and the callbacks), out-of-memory recovery (oom_recovery.py),
atomic checkpoints, a resumed paged optimizer that pages again, and the adapter saved as the final
folder holds it. The private Trainer methods it overrides are named, with the reason no public hook
serves, in private_hooks.py, which checks at import that each still exists.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import Trainer, TrainingArguments
from transformers.trainer_pt_utils import LengthGroupedSampler
from transformers.training_args import ParallelMode

from qlora_kit.memory import layer_costs, layout_costs, optimizers
from qlora_kit.memory.monitor import MemoryMonitor
from qlora_kit.model import adapters
from qlora_kit.training.run_folder.outputs import move_into_place, staging_dir
from qlora_kit.training.step import private_hooks
from qlora_kit.training.step.guards import TrainingGuard
from qlora_kit.training.step.oom_recovery import SplitOnOom
from qlora_kit.training.step.oom_split import OomPolicy
from qlora_kit.training.step.step import TrainingStep
from qlora_kit.training.watch.metrics_log import MetricsLog
from qlora_kit.training.watch.throughput import Throughput

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)

SCHEDULES = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}


def training_arguments(recipe: Recipe, output_dir: Path, has_eval: bool, precision: str):
    """The Trainer's arguments; ``precision`` is the resolved mixed precision (bf16, fp16 or no)."""
    return TrainingArguments(**training_settings(recipe, output_dir, has_eval, precision))


def training_settings(recipe: Recipe, output_dir: Path, has_eval: bool, precision: str) -> dict[str, Any]:
    """TrainingArguments' fields from the recipe (also the base of TRL's DPOConfig: objectives/dpo.py)."""
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
        # accelerate compiles the model when it prepares it (the same losses in less step time, with
        # checkpointing and the chunked loss head too: benchmarks/results/compile-cpu.md)
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
        report_to="none",  # the trackers are attached in build_trainer, after qlora_kit's callbacks (watch/trackers.py)
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


@private_hooks.checked
class GuardedTrainer(TrainingStep, SplitOnOom, Trainer):
    """The Trainer with qlora_kit's step, guards and memory accounting (see the module docstring).

    ``chunk_tokens``: tokens per chunk of the chunked loss head, or None for transformers' own loss;
    ``guard``: the training guard (None to measure a run without it); ``memory_monitor`` and
    ``metrics_log``: the callbacks that record the run, also passed in ``callbacks``; ``oom_policy``
    and ``probe``: what an out-of-memory error does, and whether the worst batch runs first (oom_recovery.py).
    """

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
        self.layer_costs: layer_costs.LayerCosts | None = None  # checkpointing auto's (training/resolved.py)
        self.layout_costs: layout_costs.LayoutCosts | None = None  # data.packing auto's
        self._staging: Path | None = None

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
        if (
            self.args.should_save and self.layout_costs is not None
        ):  # and the figures auto chose its layout by
            layout_costs.write(staged / f"checkpoint-{self.state.global_step}", self.layout_costs)
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
            self.load_split(Path(checkpoint))
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
