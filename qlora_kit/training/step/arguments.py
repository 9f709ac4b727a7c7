"""What the Trainer is given from a recipe: its arguments (also the base of TRL's configs), and one
process pinned to one GPU."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainingArguments
from transformers.training_args import ParallelMode

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
        # never the whole model: train.compile compiles the decoder layers (training/compiled.py)
        torch_compile=False,
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
