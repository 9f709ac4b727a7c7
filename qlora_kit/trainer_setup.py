"""Building transformers' Trainer from a recipe, and the callback that writes ``metrics.jsonl``.

Imported only when a run starts (transformers is heavy), so it imports transformers at the top.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from qlora_kit import data, memory
from qlora_kit.guards import GradientGuard, check_loss

if TYPE_CHECKING:
    from qlora_kit.recipe import Recipe

SCHEDULES = {"constant": "constant_with_warmup", "cosine": "cosine", "linear": "linear"}


def training_arguments(recipe: Recipe, output_dir: Path, has_eval: bool):
    import torch
    from transformers import TrainingArguments

    train, opt = recipe.train, recipe.optimizer
    evaluating = has_eval and train.eval_steps is not None
    return TrainingArguments(
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
        # bf16 autocast on GPUs (the QLoRA setting); on CPUs the 4-bit layers already compute in
        # quant.compute_dtype and the fp32 LoRA matrices are faster without autocast's casts.
        bf16=recipe.quant.compute_dtype == "bfloat16" and torch.cuda.is_available(),
        fp16=recipe.quant.compute_dtype == "float16" and torch.cuda.is_available(),
        label_names=["labels"],  # peft's wrapper hides the signature the Trainer infers this from
        report_to="none",  # tensorboard is attached below with a fixed folder
        dataloader_pin_memory=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),
    )


class GuardedTrainer(Trainer):
    """The Trainer, stopping at the first step whose loss is NaN or infinite (see guards.py)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        check_loss(loss, self.state.global_step + 1, get_last_checkpoint(self.args.output_dir))
        return loss


def build_trainer(
    recipe: Recipe, peft_model, tokenizer, train_set, val_set, output_dir: Path, callbacks: list | None = None
) -> GuardedTrainer:
    from transformers.integrations import TensorBoardCallback

    args = training_arguments(recipe, output_dir, has_eval=val_set is not None)
    metrics_log = MetricsLog(output_dir / "metrics.jsonl")
    trainer = GuardedTrainer(
        model=peft_model,
        args=args,
        train_dataset=train_set,
        eval_dataset=val_set if args.eval_strategy != "no" else None,
        data_collator=data.build_collator(tokenizer, packing=recipe.data.packing),
        processing_class=tokenizer,
        optimizer_cls_and_kwargs=memory.optimizer_class_and_kwargs(recipe.optimizer),
        callbacks=[
            metrics_log,
            GradientGuard(peft_model),
            TensorBoardCallback(_summary_writer(output_dir / "tensorboard")),
            *(callbacks or []),
        ],
    )
    trainer.metrics_log = metrics_log
    return trainer


def _summary_writer(folder: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(folder))


class MetricsLog(TrainerCallback):
    """A Trainer callback: one JSON object per log event (step, loss, eval_loss, lr) in metrics.jsonl."""

    KEYS: ClassVar[dict[str, str]] = {
        "loss": "loss",
        "eval_loss": "eval_loss",
        "learning_rate": "lr",
        "grad_norm": "grad_norm",
    }

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs) -> None:
        if not state.is_world_process_zero or not logs:
            return
        row: dict[str, Any] = {"step": state.global_step}
        for key, name in self.KEYS.items():
            value = logs.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                row[name] = float(value)
        if len(row) == 1:
            return  # end-of-training summaries carry none of the per-step keys
        row["epoch"] = round(float(state.epoch or 0.0), 4)
        self.rows.append(row)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
