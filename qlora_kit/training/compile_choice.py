"""Training stage: ``train.compile`` resolved (true, false or auto) and applied, before step 1.

``auto`` compiles the decoder layers (compiled.py) where the run repays the compile, decided by measuring:

1. a run of fewer than ``MIN_STEPS`` optimizer steps, of several processes (each would time its own
   step), of an objective whose batches are not token rows with labels, of a model whose layers all stay
   eager (``compiled.all_eager_reason``: recurrent layers only; its timed steps would be eager steps), or
   of a mixture whose experts are kept on the host (their copies to the device, which each timed step
   would make too, are the step's time: the compiled part of its layers saves little of it) stays eager
   unmeasured;
2. an eager forward and backward of a micro-batch of the run's own rows is timed: if the planned steps,
   saving at most ``LARGEST_SAVING`` of their eager time, cannot repay the compiles the run makes
   (``EXPECTED_COMPILES``) at a decoder layer's least compile (``LAYER_COMPILE_FLOOR_S``) each, it stays
   eager, and the compiler is never started (its first start is 12-15 s of a short run);
3. the device's compiler must work (``compiled.compiler_works``), and the same bound must hold with a
   small graph's compile timed here (``compiled.least_compile_seconds``) when that is the larger;
4. otherwise the layers are compiled and the same micro-batch timed twice: the first call is the compile,
   the second the compiled step. Compiled when the saving over the planned steps exceeds the compile
   times the compiles the run makes; the compiled graphs are kept for the run, and removed again when it
   does not pay, or when the compile fails on this model's layers (the error's first line is the reason).

The decision and its figures are logged as ``memory.chunked_loss: auto``'s are.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from qlora_kit.memory import experts_on_host
from qlora_kit.registries import objectives
from qlora_kit.training import compiled

if TYPE_CHECKING:
    from transformers import Trainer

    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)

# Fewer steps than this are never measured: the measurement costs three eager steps and a compile (0.4 s
# from inductor's disk cache, 12 s without it, on 2 loaded cores), after the compiler's first start in the
# process (12-15 s here); the suite's short runs and the quick recipes stay unmeasured (none trains 50).
MIN_STEPS = 50
# The largest share of a step compiling has saved in our measurements: 0.30 without checkpointing and 0.35
# under the defaults (the whole model on the CPU, issue 80's benchmarks/results/compile-cpu.md of
# 2026-11-29; the regional compile saved less). Bounding the saving by the whole eager step instead let a
# small graph's cached compile (0.4 s) send every run of 50 steps into a timed compile of its layers
# (seconds to minutes), which most then refused: 64 s of benchmarks/attention.py's 102 s at smoke size.
LARGEST_SAVING = 0.4
# The least a decoder layer's compile (forward and backward) has taken in our measurements: 8.4 s for the
# tiny Llama's layer under full checkpointing, and 10.8 s in the README's demo on a clean clone, 2 cores
# (2026-12-06). The small graph compiled and timed on the run (compiled.least_compile_seconds) is the floor
# of any compile here, but a layer's graph is many times larger: with that floor alone the demo timed a
# compile of its layers before step 1 and ran 19 s longer end to end (88 s -> 107 s), to stay eager. A GPU
# compiles a layer more slowly still, so this floor only keeps the decision conservative.
LAYER_COMPILE_FLOOR_S = 8.0
HOST_EXPERTS_REASON = (
    "auto: the experts' copies from the host are the step's time, which compiling the rest of a layer "
    "does not shorten; train.compile: true compiles"
)
# A graph for the first shapes, a recompile with the sequence dynamic (compiled.py); evaluation runs eager.
EXPECTED_COMPILES = 2


@dataclass(frozen=True)
class CompileChoice:
    enabled: bool
    reason: str


def resolve_compile(recipe: Recipe, trainer: Trainer, model: torch.nn.Module) -> CompileChoice:
    """Resolve ``train.compile`` for this run, compile the decoder layers when on, and log why."""
    setting = recipe.train.compile
    if setting is True:
        choice = CompileChoice(True, "train.compile: true")
    elif setting is False:
        choice = CompileChoice(False, "train.compile: false")
    else:
        choice = _auto(recipe, trainer, model)
    if choice.enabled and not compiled.decoder_layers_compiled(model):
        compiled.compile_decoder_layers(model)
    log.info("train.compile: %s (%s)", "on" if choice.enabled else "off", choice.reason)
    return choice


def planned_steps(recipe: Recipe, trainer: Trainer) -> int:
    """The optimizer steps the run will take: ``train.max_steps``, else epochs of the training rows."""
    train = recipe.train
    return steps_of(
        train.max_steps, len(trainer.train_dataset), train.micro_batch_size * train.grad_accum, train.epochs
    )


def steps_of(max_steps: int | None, rows: int, rows_per_step: int, epochs: float) -> int:
    """Optimizer steps: ``max_steps`` when set, else ``epochs`` over ``rows`` (each epoch's last step partial);
    packing auto counts its planned micro-batches with it too (batch_layout.py)."""
    return max_steps or math.ceil(rows / rows_per_step) * math.ceil(epochs)


def _auto(recipe: Recipe, trainer: Trainer, model: torch.nn.Module) -> CompileChoice:
    steps = planned_steps(recipe, trainer)
    if steps < MIN_STEPS:
        return CompileChoice(
            False, f"auto: {steps} planned steps, fewer than {MIN_STEPS} never repay a compile"
        )
    if trainer.args.world_size > 1:  # each process would time its own step, and might decide otherwise
        return CompileChoice(False, "auto: decided in one process only; train.compile: true compiles")
    if objectives.of(recipe).rows != objectives.SEQUENCES:
        return CompileChoice(False, "auto: measured on token rows only; train.compile: true compiles")
    family = compiled.all_eager_reason(model)
    if family:  # compile_decoder_layers would leave every layer eager: nothing to time
        return CompileChoice(False, f"auto: every decoder layer stays eager ({family})")
    if experts_on_host.layers_on_host(model):
        return CompileChoice(False, HOST_EXPERTS_REASON)
    batch = _micro_batch(recipe, trainer)
    eager_s = min(_timed_steps(trainer, model, batch, 3)[1:])  # the first call warms up
    # the floor first: a run that cannot repay a layer's compile never pays the compiler's start either
    refused = unrepaid(steps, eager_s, LAYER_COMPILE_FLOOR_S)
    if refused:
        return CompileChoice(False, refused)
    works, detail = compiled.compiler_works()
    if not works:
        return CompileChoice(False, f"auto: the compiler does not work here ({detail})")
    refused = unrepaid(steps, eager_s, max(compiled.least_compile_seconds(), LAYER_COMPILE_FLOOR_S))
    if refused:
        return CompileChoice(False, refused)
    compiled.compile_decoder_layers(model)
    try:
        first_s, compiled_s = _timed_steps(trainer, model, batch, 2)
    except torch._dynamo.exc.TorchDynamoException as exc:  # this model's layers break the compiler: run eager
        compiled.uncompile_decoder_layers(model)
        model.zero_grad(set_to_none=True)
        return CompileChoice(False, f"auto: compiling the layers failed: {first_line(exc)}")
    choice = timed_choice(steps, eager_s, first_s - compiled_s, compiled_s)
    if not choice.enabled:
        compiled.uncompile_decoder_layers(model)
    return choice


def first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return f"{exc.__class__.__name__}: {lines[0][:200] if lines else ''}"


def timed_choice(steps: int, eager_s: float, compile_s: float, compiled_s: float) -> CompileChoice:
    """On when ``steps`` steps save more (eager step ``eager_s`` less compiled step ``compiled_s``) than the
    run's compiles cost at ``compile_s`` each (the first compiled call less a compiled step); measured.
    A compile served from inductor's cache can time below a compiled step: it costs nothing, and the line
    says 0, the figure the choice used (it said "-0.0 s")."""
    compile_s = max(compile_s, 0.0)
    cost = compile_s * EXPECTED_COMPILES
    saving = (eager_s - compiled_s) * steps
    figures = (
        f"{steps} steps x ({eager_s:.3f} s eager - {compiled_s:.3f} s compiled) = {saving:.1f} s saved "
        f"against {EXPECTED_COMPILES} compiles of {compile_s:.1f} s"
    )
    return CompileChoice(saving > cost, f"auto: {figures}")


def unrepaid(steps: int, eager_s: float, least_compile_s: float) -> str | None:
    """Why ``steps`` eager steps of ``eager_s`` cannot repay the run's compiles at ``least_compile_s`` each,
    both measured on this run (None: they might, so a compile is timed)."""
    bound = steps * eager_s * LARGEST_SAVING
    if bound >= least_compile_s * EXPECTED_COMPILES:
        return None
    return (
        f"auto: {steps} steps of {eager_s:.3f} s save at most {bound:.2f} s, under the "
        f"{EXPECTED_COMPILES} compiles of at least {least_compile_s:.2f} s the run would make"
    )


def _micro_batch(recipe: Recipe, trainer: Trainer) -> dict[str, torch.Tensor]:
    """The first micro-batch of the training rows, collated as the Trainer collates them, on the device."""
    count = min(recipe.train.micro_batch_size, len(trainer.train_dataset))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(count)])
    device = next(p.device for p in trainer.model.parameters())
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _timed_steps(trainer: Trainer, model: torch.nn.Module, batch: dict, count: int) -> list[float]:
    """Seconds of each of ``count`` forward and backward passes on ``batch``, under the run's autocast;
    the random state and the gradients are left as they were (none)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    times = []
    was_training = model.training
    model.train()
    with torch.random.fork_rng(devices=devices):
        for _ in range(count):
            start = time.perf_counter()
            with trainer.accelerator.autocast():
                loss = model(**batch).loss
            loss.backward()
            if devices:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    return times
