"""A few of the run's decoder layers, built at random and loaded as the run loads them, and the clock that
times them: what ``auto`` choices measure before the real weights load (``layer_costs``: checkpointing
auto's recompute costs; ``layout_costs``: ``data.packing: auto``'s cost per position).

- The model's config is cut to ``LAYERS`` decoder layers, built at random in the compute dtype, written to a
  temporary folder and loaded back through ``loading.load_base_model`` (4-bit, on this process's device),
  with checkpointing and LoRA set up as the run sets them up.
- On a GPU the clock is wall seconds; on a CPU the CPU seconds of one thread: on a CPU other jobs share (the
  2-core machine here, at a load of 8), two threads' wall and CPU time swing tenfold with the others' load
  (the threads spin waiting for each other), one thread's CPU time by a few percent.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from qlora_kit.recipe.memory import MemorySection
    from qlora_kit.recipe.recipe import Recipe

LAYERS = 4  # decoder layers timed: enough that a layer's cost stands out of the embeddings' and the noise


@dataclass
class CutModel:
    """The cut model ready to step: the LoRA-wrapped model, its 4-bit base, the clock and the autocast."""

    peft_model: torch.nn.Module
    base: torch.nn.Module
    device: torch.device
    autocast: contextlib.AbstractContextManager
    clock: Callable[[], float]
    synchronize: Callable[[], None]


@contextlib.contextmanager
def cut_model(recipe: Recipe, config, memory: MemorySection, precision: str) -> Iterator[CutModel]:
    """``LAYERS`` of the model's decoder layers, 4-bit with LoRA and ``memory``'s checkpointing, under the
    Trainer's autocast ``precision``; on a CPU torch runs one thread until the block ends."""
    from transformers import AutoModelForCausalLM

    from qlora_kit.memory import checkpointing
    from qlora_kit.memory.fake_forward import AUTOCAST, cut
    from qlora_kit.memory.tracing import layer_types
    from qlora_kit.model import adapters, loading

    short = cut(config, tuple(range(min(LAYERS, len(layer_types(config))))))
    # the random weights, LoRA's A and the timed steps' dropout draw from a stream of their own, not the run's
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with tempfile.TemporaryDirectory(prefix="qlora-kit-cut-model-") as name, torch.random.fork_rng(devices):
        folder = Path(name)
        dense = AutoModelForCausalLM.from_config(
            short,
            dtype=getattr(torch, recipe.quant.compute_dtype),
            trust_remote_code=recipe.model.trust_remote_code,
        )
        dense.save_pretrained(folder)
        del dense
        # load_base_model checks the folder is a whole model; no tokenizer is read from it
        (folder / "tokenizer_config.json").write_text("{}\n")
        with _quiet("qlora_kit.model", "qlora_kit.memory"):  # the run's own load says all this once
            base = loading.load_base_model(recipe.model, recipe.quant, path=str(folder))
            checkpointing.enable_checkpointing(base, memory)
            peft_model = adapters.attach_lora(base, recipe.lora)
        peft_model.train()
        device = base.device
        dtype = AUTOCAST.get(precision)
        autocast = torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()
        cuda = device.type == "cuda"
        threads = torch.get_num_threads()
        if not cuda:
            torch.set_num_threads(1)
        try:
            yield CutModel(
                peft_model,
                base,
                device,
                autocast,
                time.perf_counter if cuda else time.process_time,
                torch.cuda.synchronize if cuda else (lambda: None),
            )
        finally:
            torch.set_num_threads(threads)
            peft_model.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """These loggers say only warnings and errors until the block ends."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def release() -> None:
    """Give the cut model's memory back before the run loads its own: a model's modules hold reference
    cycles that only the collector frees, and on a GPU the caching allocator keeps what they held."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
