"""The whole pipeline, top to bottom: ``build(recipe)`` sets a run up, ``run(recipe)`` is build + train + save.

build: load tokenizer -> tokenize data -> load 4-bit base -> checkpointing policy -> attach LoRA ->
transformers' Trainer for the objective with the chosen optimizer (objective_trainer.py). run adds the output folder (lock,
checks, manifest), training, the final save and the samples. The Trainer owns the loop. Benchmarks,
``qlora-kit doctor`` and notebooks set runs up through ``build`` (or ``run``); the tests of the Trainer
subclass itself build one with ``objective_trainer.build_trainer``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import TrainerState, set_seed

from qlora_kit.data import preflight, prepare
from qlora_kit.data.rewards import check_importable
from qlora_kit.errors import Interrupted, RecipeError
from qlora_kit.memory import attention_fit, auto, checkpointing, experts_on_host, loss_choice
from qlora_kit.model import adapters, builtin, hub, layer_sizes
from qlora_kit.model import loading as model
from qlora_kit.model.paths import (
    check_adapter_folder,
    check_checkpoint,
    check_model_folder,
    check_output_folder,
    check_output_holds_no_input,
)
from qlora_kit.model.precision import resolve_mixed_precision
from qlora_kit.registries import attention, objectives
from qlora_kit.registries import metric_keys as keys
from qlora_kit.training import batch_layout, compile_choice, sample_prompts
from qlora_kit.training.distributed import Ranks, check_fsdp_launch, launched_fsdp_settings
from qlora_kit.training.objective_trainer import build_trainer, builder
from qlora_kit.training.resolved import ResolvedRun
from qlora_kit.training.run_folder.manifest import utc_now, write_manifest
from qlora_kit.training.run_folder.outputs import (
    FINISHED_MARKER,
    after_failed_overwrite,
    check_output_dir,
    clear_staging,
    complete_checkpoints,
    drop_aside,
    exclusive,
    find_resume_checkpoint,
    finished_training,
    move_into_place,
    prepare_run_folder,
    staging_dir,
)
from qlora_kit.training.run_folder.run_record import tokens_per_s
from qlora_kit.training.step import callbacks as step_callbacks
from qlora_kit.training.step.interrupts import StopOnSignal
from qlora_kit.training.step.trainer import GuardedTrainer
from qlora_kit.training.watch import run_log, trackers

if TYPE_CHECKING:
    from peft import PeftModel
    from rich.console import Console
    from transformers import PreTrainedTokenizerBase

    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)


@dataclass
class Setup:
    """A run ready to train, exactly as ``run`` trains it."""

    recipe: Recipe
    tokenizer: PreTrainedTokenizerBase
    data: prepare.PreparedData
    model: PeftModel
    trainer: GuardedTrainer
    checkpointed_layers: list[int]
    run: ResolvedRun  # what the recipe left to the machine, the data or the launch, resolved once


@dataclass
class TrainResult:
    """What a run leaves behind: where it wrote, what it logged, and the trained model in memory."""

    output_dir: Path
    metrics: list[dict[str, Any]]
    model: PeftModel
    tokenizer: PreTrainedTokenizerBase
    checkpointed_layers: list[int] = field(default_factory=list)
    samples: list[dict[str, str]] = field(default_factory=list)
    memory: dict[str, Any] = field(default_factory=dict)  # the run's largest saved bytes, CUDA peaks
    main_process: bool = True  # False on the other ranks of a multi-process run (they print nothing)
    steps: int = 0  # optimizer steps the run has taken (a resumed run: counted from the start)

    @property
    def eval_losses(self) -> list[float]:
        return [row["eval_loss"] for row in self.metrics if "eval_loss" in row]

    @property
    def train_losses(self) -> list[float]:
        return [row["loss"] for row in self.metrics if "loss" in row]


def check_runnable(recipe: Recipe) -> tuple[dict[str, str] | None, str]:
    """What can be refused before any work: missing local paths, a base-model folder that cannot load, an
    output folder that cannot be written, a launch the recipe does not match, a mixed precision this
    machine cannot run. Returns the launch and the mixed precision, resolved (resolved.py)."""
    recipe.check_paths()
    output_dir = Path(recipe.train.output_dir).expanduser().resolve()
    check_output_folder(output_dir, "train.output_dir")
    check_output_holds_no_input(output_dir, dict(recipe.input_paths()))
    if not builtin.is_builtin(recipe.model.path):  # builtin models are built, then loaded, by build()
        check_model_folder(recipe.model.path)
        if Path(recipe.model.path).expanduser().is_dir():  # read here, not fetched: a hub id's is at load
            layer_sizes.check_layers_counted(model.load_config(recipe.model))
    if recipe.model.adapter is not None:
        folder = Path(recipe.model.adapter).expanduser()
        bias = check_adapter_folder(folder, "model.adapter").get("bias", "none")
        if objectives.of(recipe).reference and bias != "none":
            raise RecipeError(
                f"model.adapter: {folder} trains biases (bias: {bias}); {recipe.train.objective}'s reference is a second adapter, "
                "and peft allows trained biases in one adapter only"
            )
    check_importable([entry.name for entry in recipe.grpo.rewards])  # a module:function reward not importable
    launch = launched_fsdp_settings()
    if recipe.train.fsdp and launch is None:
        raise RecipeError(
            "train.fsdp: the recipe shards the model with FSDP; launch it with accelerate launch "
            "--config_file recipes/accelerate/fsdp-qlora.yaml --num_processes N -m qlora_kit train RECIPE"
        )
    check_fsdp_launch(recipe, launch)
    precision = resolve_mixed_precision(recipe)
    unavailable = attention.check_installed(recipe.model.attn_implementation, torch.cuda.is_available())
    unavailable = unavailable or trackers.check_installed(recipe.train.report_to)
    if unavailable:
        raise RecipeError(unavailable)
    return launch, precision


def build(
    recipe: Recipe, output_dir: Path | None = None, callbacks: list | None = None, guards: bool = True
) -> Setup:
    """Everything a run trains with; nothing is written. ``output_dir`` defaults to the recipe's;
    ``callbacks`` are extra ``transformers.TrainerCallback`` objects; ``guards=False`` drops the loss and
    gradient guards (for measuring what they cost; never for a run)."""
    checked = check_runnable(recipe)
    return _build_checked(recipe, checked, output_dir, callbacks, guards)


def _build_checked(
    as_written: Recipe,
    checked: tuple[dict[str, str] | None, str],
    output_dir: Path | None,
    callbacks: list | None,
    guards: bool,
    checkpoint: Path | None = None,
) -> Setup:
    """``build`` after ``check_runnable`` (``run`` checks before it takes the output folder), with the
    launch and precision it resolved; ``checkpoint``:
    the one a resumed run continues (checkpointing auto chooses with the costs it measured).
    ``as_written``: the recipe as given (what recipe.yaml holds and the trackers log); ``recipe``, from the
    layout's stage on, the one the run trains by (data.packing resolved)."""
    output_dir = output_dir or Path(as_written.train.output_dir).expanduser().resolve()
    # What the hub can refuse (a gated or missing model or dataset, no network, a full disk) is asked
    # first, in a few requests, before the data is tokenized or the weights are fetched.
    hub.check_model(as_written.model)
    hub.check_dataset(as_written.data)
    set_seed(as_written.train.seed)
    tokenizer = model.load_tokenizer(as_written.model)
    # Data before weights: a mistake in the data is found in seconds, not after loading a large model.
    spec = objectives.of(as_written)
    with Ranks().main_first():  # the objective's module prepares its rows (registries/objectives.py)
        rows = builder(as_written).prepare(as_written, tokenizer)
    launch, precision = checked
    recipe, prepared, layout_figures = batch_layout.resolve(
        as_written, rows, tokenizer, checkpoint, precision
    )
    # checkpointing auto: planned from the config and the data's trained share (before the weights load),
    # refused here if no policy fits
    share = prepared.largest_trained_share() if spec.chunked_head else 1.0
    images, image_tokens = prepared.most_images_per_row(), prepared.most_image_tokens_per_row()
    if spec.chunked_head:  # memory.chunked_loss auto: full logits where they fit (TRL's heads keep none)
        recipe = loss_choice.resolve_head(
            recipe, trained_share=share, images_per_row=images, image_tokens=image_tokens
        )
    memory, costs = auto.resolve_auto(recipe, checkpoint, share, images, image_tokens)
    resolved = ResolvedRun(
        recipe, as_written, spec, launch, precision, memory, costs, output_dir, layout_figures
    )
    # a run that would train on nothing stops here, before the weights (GRPO trains on no labelled token)
    if recipe.data.preflight.enabled and spec.preflight:
        collator = (
            None  # pairs: TRL's collator marks the answers by a mask, never by the pad id
            if spec.rows != objectives.SEQUENCES
            else prepare.build_collator(tokenizer, recipe.data.packs, recipe.model.attn_implementation)
        )
        preflight.enforce(preflight.run_checks(prepared, recipe.data, tokenizer, collator))
    # memory.experts_on_host: the experts kept on the host as they load, before peft wraps them
    keep_on_host = functools.partial(experts_on_host.keep_experts_on_host, field="memory.experts_on_host")
    to_host = keep_on_host if resolved.memory.experts_on_host else None
    base = model.load_base_model(recipe.model, recipe.quant, experts_to_host=to_host)
    attention_fit.check_attention_fits(
        base.config, recipe.train.micro_batch_size, recipe.data.max_seq_len, recipe.memory.budget_gb
    )
    checkpointed = checkpointing.enable_checkpointing(base, resolved.memory)
    if recipe.model.adapter is not None:  # continue a trained adapter (for dpo: the SFT one)
        peft_model = adapters.load_adapter(
            base, Path(recipe.model.adapter).expanduser(), True, "model.adapter"
        )
        adapters.log_continued_shape(peft_model, recipe)
    else:
        peft_model = adapters.attach_lora(base, recipe.lora)
    trainer = build_trainer(resolved, peft_model, tokenizer, prepared.train, prepared.val, callbacks, guards)
    compile_choice.resolve_compile(recipe, trainer, peft_model)  # train.compile, measured for auto
    if spec.reference:
        log.info(
            "%s: the reference policy is %s", spec.name, trainer.reference_description(recipe.model.adapter)
        )
    if spec.disables_dropout:  # TRL's disable_dropout: policy and reference score the same answer alike
        log.info("%s: dropout is off, lora.dropout included (TRL's default)", spec.name)
    return Setup(recipe, tokenizer, prepared, peft_model, trainer, checkpointed, resolved)


def run(
    recipe: Recipe,
    overwrite: bool = False,
    resume: bool | str | Path = False,
    callbacks: list | None = None,
    guards: bool = True,
    console: Console | None = None,
) -> TrainResult:
    """Fine-tune the recipe's base model with QLoRA and save the adapter into ``recipe.train.output_dir``.

    ``resume``: True continues from the newest complete checkpoint in the output dir, a path from that
    checkpoint. ``callbacks`` and ``guards`` as for ``build``. ``console``: show progress there
    (watch/run_console.py) instead of the Trainer's progress bars and printed log dicts.
    """
    checked = check_runnable(recipe)
    log.debug("the resolved recipe:\n%s", recipe.to_yaml())
    ranks = Ranks()
    output_dir = Path(recipe.train.output_dir).expanduser().resolve()
    with exclusive(output_dir) if ranks.is_main else contextlib.nullcontext():
        checkpoint = _checkpoint_to_resume(output_dir, resume, overwrite)
        stopper = StopOnSignal()
        setup = _build_checked(recipe, checked, output_dir, [stopper, *(callbacks or [])], guards, checkpoint)
        _announce(setup, ranks, console)
        examples = sample_prompts.examples(setup.data, setup.recipe, setup.tokenizer, ranks)
        before = sample_prompts.answers(setup.model, setup.tokenizer, examples)
        manifest, aside = (
            prepare_run_folder(output_dir, recipe, setup.model, overwrite, resume, checkpoint)
            if ranks.is_main
            else ({}, None)
        )
        try:
            _train_and_save(setup, stopper, checkpoint, output_dir, ranks, manifest)
        except BaseException:
            if aside is not None:
                after_failed_overwrite(output_dir, aside)
            raise
        if aside is not None:
            drop_aside(aside)
    after = sample_prompts.answers(setup.model, setup.tokenizer, examples)
    samples = sample_prompts.records(examples, before, after)
    usage = _usage(setup.trainer, checkpoint)
    if ranks.is_main:
        run_log.log_memory(usage)
        log.info("adapter, tokenizer and recipe written to %s", output_dir)
    return TrainResult(
        output_dir=output_dir,
        metrics=setup.trainer.metrics_log.rows,
        model=setup.model,
        tokenizer=setup.tokenizer,
        checkpointed_layers=setup.checkpointed_layers,
        samples=samples,
        memory=usage,
        main_process=ranks.is_main,
        steps=setup.trainer.state.global_step,
    )


def _checkpoint_to_resume(output_dir: Path, resume: bool | str | Path, overwrite: bool) -> Path | None:
    """The checkpoint a --resume continues (checked), or None; a fresh run's folder is checked instead."""
    checkpoint = find_resume_checkpoint(output_dir, resume) if resume else None
    if checkpoint is not None:
        check_checkpoint(checkpoint)
    if not resume:
        check_output_dir(output_dir, overwrite=overwrite)
    return checkpoint


def _announce(setup: Setup, ranks: Ranks, console: Console | None) -> None:
    """The run console replaces the Trainer's output; the main process logs the setup."""
    if console is not None:
        step_callbacks.show_on(setup.trainer, console)
    if ranks.is_main:
        run_log.log_setup(
            setup.model, setup.checkpointed_layers, setup.data, setup.recipe.data, setup.recipe.train
        )
        run_log.log_optimizer_state(setup.model, setup.recipe.optimizer.name)
        if objectives.of(setup.recipe).rollouts:  # its two peaks (grpo/oom.py)
            run_log.log_grpo_peaks(setup.recipe, setup.trainer.args.device.type)
        # read back from accelerate, not the recipe: the autocast the forward will actually run under
        log.info("mixed precision: %s", setup.trainer.accelerator.mixed_precision)


def _train_and_save(
    setup: Setup,
    stopper: StopOnSignal,
    checkpoint: Path | None,
    output_dir: Path,
    ranks: Ranks,
    manifest: dict,
) -> None:
    """Train (or resume), save the final adapter, and finish the manifest (with the best step kept)."""
    trainer, peft_model = setup.trainer, setup.model
    ranks.barrier()
    _train(trainer, stopper, peft_model, checkpoint, output_dir)
    # Take accelerate's autocast wrapper off the model's forward: the model handed back computes
    # as it does once loaded from disk (generate, eval, a notebook), not under the training autocast.
    trainer.accelerator.unwrap_model(peft_model, keep_fp32_wrapper=False)
    _save_final(trainer, peft_model, setup.tokenizer, output_dir, ranks, setup.recipe.train.fsdp)
    if ranks.is_main:
        ended = {"finished_at": utc_now(), "steps": trainer.state.global_step, **_best(trainer)}
        write_manifest(output_dir, manifest | ended)
        if "best" in ended:
            best = ended["best"]
            log.info(
                "train.keep_best: the final adapter is step %d's (%s %.4g)",
                best["step"],
                best["metric"],
                best["value"],
            )
    ranks.barrier()


def _usage(trainer, checkpoint: Path | None) -> dict[str, Any]:
    """The run's memory figures, its tokens/s and, after a resume, how many optimizer tensors were re-paged."""
    usage = trainer.memory_monitor.summary()
    speed = tokens_per_s(trainer.metrics_log.rows)
    if speed is not None:
        usage[keys.TOKENS_PER_S] = speed  # the figure `qlora-kit show` reads back from metrics.jsonl
    if checkpoint is not None:
        usage["repaged_optimizer_tensors"] = trainer.repaged_tensors
    return usage


def _train(trainer, stopper: StopOnSignal, peft_model, checkpoint: Path | None, output_dir: Path) -> None:
    stopper.install()
    try:
        if checkpoint is not None and finished_training(checkpoint, trainer.args.max_steps):
            # killed while saving the final output: the checkpoint's state says which adapter is final
            trainer.state = TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
            best = trainer.state.best_model_checkpoint if trainer.args.load_best_model_at_end else None
            final = Path(best) if best and Path(best).is_dir() else checkpoint
            set_peft_model_state_dict(peft_model, load_file(final / "adapter_model.safetensors"))
        else:
            if checkpoint is not None:
                # The baseline evaluation belongs to step 0: at the resumed step it would log that step's
                # evaluation a second time, and count as "no improvement" for early stopping.
                trainer.args.eval_on_start = False
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    finally:
        stopper.restore()
    if stopper.stopped:
        newest = complete_checkpoints(output_dir)
        raise Interrupted(
            stopper.received or 15, trainer.state.global_step, str(newest[-1]) if newest else None
        )


def _save_final(trainer, peft_model, tokenizer, output_dir: Path, ranks: Ranks, fsdp: bool) -> None:
    """Adapter and tokenizer (a vision-language model's processor), staged and renamed into place; adapter_config.json (the finished marker) last.
    Under FSDP every rank takes part in gathering the sharded adapter."""
    staged = staging_dir(output_dir, name="final")
    adapter = adapters.full_adapter_state(peft_model) if fsdp else None  # a collective: every rank
    if ranks.is_main:
        adapters.save_adapter(peft_model, staged, adapter)
        # a vision-language run's processor (its tokenizer, image processor and chat template: images.py)
        processor = getattr(trainer.data_collator, "processor", None)
        (processor or tokenizer).save_pretrained(staged)
        move_into_place(staged, output_dir, last=FINISHED_MARKER)
        clear_staging(output_dir)  # a finished run leaves no empty .staging/ behind


def _best(trainer) -> dict[str, Any]:
    """The manifest's record of train.keep_best: which evaluation's adapter is the final one."""
    if not trainer.args.load_best_model_at_end or trainer.state.best_global_step is None:
        return {}
    metric, value = trainer.args.metric_for_best_model, trainer.state.best_metric
    return {"best": {"metric": metric, "value": value, "step": trainer.state.best_global_step}}
