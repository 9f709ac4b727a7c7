"""What one process of a multi-process run (``accelerate launch``, torchrun) does differently.

Every rank loads the 4-bit model onto its own device and trains its shard of each batch; the Trainer
(through accelerate) all-reduces the gradients. Only the main process touches the output folder:
the lock, the checks, the manifest, logs, checkpoints' shared files and the final adapter. The others
wait at barriers. A single process is the same code with one rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import yaml
from accelerate import PartialState

from qlora_kit.errors import RecipeError

if TYPE_CHECKING:
    from qlora_kit.recipe.recipe import Recipe

log = logging.getLogger(__name__)


class Ranks:
    def __init__(self) -> None:

        # The first PartialState of a process fixes its distributed setup; on a machine without CUDA it
        # must be told cpu=True to join a multi-process (gloo) run, as the Trainer's would be.
        self.state = PartialState(cpu=not torch.cuda.is_available())

    @property
    def is_main(self) -> bool:
        return self.state.is_main_process

    @property
    def count(self) -> int:
        return self.state.num_processes

    def barrier(self) -> None:
        if self.count > 1:
            self.state.wait_for_everyone()

    def main_first(self):
        """The main process runs the block first (e.g. to fill datasets' cache), then the others."""
        return self.state.main_process_first() if self.count > 1 else contextlib.nullcontext()


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any rank (so all ranks stop at the same step)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return flag  # one process: nothing to agree on, and no tensor to read back each step
    return bool(over_ranks(torch.tensor([1 if flag else 0]), dist.ReduceOp.MAX).item())


def over_ranks(values: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``values`` reduced element-wise over all ranks (``op``: SUM or MAX), on the device the backend
    needs (NCCL: this process's GPU); ``values`` themselves in a single process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    reduced = values.to(device)
    dist.all_reduce(reduced, op=op)
    return reduced


def leave_process_group() -> None:
    """Destroy this process's process group, if it joined one, before the interpreter shuts down.

    Left to exit, gloo's worker threads can still hold work whose tensors reach into Python while the
    interpreter is torn down, and the process dies of SIGABRT ("terminate called without an active
    exception") after the run has finished and saved: torchrun then calls the whole run failed
    (pytorch/pytorch#179291 describes it; torch does not do this for us)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # a group a failed peer left broken: the run's own exit and message stand
        log.debug("leaving the process group failed: %s", exc)


def launched_with_fsdp() -> bool:
    """accelerate sets this for a run launched with an FSDP config."""
    return os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")


def launched_fsdp_settings() -> dict[str, str] | None:
    """The FSDP settings of this launch (accelerate exports each ``fsdp_config`` key as ``FSDP_<KEY>``),
    or None when it is not an FSDP launch."""
    if not launched_with_fsdp():
        return None
    return {key: value for key, value in os.environ.items() if key.startswith("FSDP_")}


def fsdp_settings_of(config_file: Path) -> dict[str, str] | None:
    """The same settings read from an accelerate config file, or None when it does not configure FSDP."""
    try:
        config = yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise RecipeError(f"--accelerate-config: cannot read {config_file} ({exc})") from None
    if not isinstance(config, dict) or str(config.get("distributed_type", "")).upper() != "FSDP":
        return None
    fsdp = config.get("fsdp_config") or {}
    return {key.upper(): str(value) for key, value in fsdp.items()}


def check_fsdp_launch(recipe: Recipe, settings: dict[str, str] | None) -> None:
    """Refuse, with the reason, a recipe and FSDP launch settings that cannot train together.

    Each refusal was reproduced on CPU processes (tests/e2e/test_fsdp.py has the working path).
    """
    if settings is None:
        return
    if not recipe.train.fsdp:
        raise RecipeError(
            "train.fsdp: this run is launched with an FSDP config; set train.fsdp: true "
            "(and quant.quant_storage equal to quant.compute_dtype)"
        )

    def setting(key: str, default: str) -> str:
        return settings.get(f"FSDP_{key}", default).strip().lower()

    # accelerate's default when the config names no version is FSDP1
    if setting("VERSION", "1") != "2":
        raise RecipeError(
            "fsdp_version: qlora_kit trains with FSDP2 (fsdp_version: 2 in the accelerate config); FSDP1 "
            "wraps modules in FlatParameters that rename every LoRA parameter and that bitsandbytes' "
            "4-bit layers were not built for"
        )
    if setting("STATE_DICT_TYPE", "sharded_state_dict") != "sharded_state_dict":
        raise RecipeError(
            "fsdp_state_dict_type: use SHARDED_STATE_DICT; checkpoints keep the optimizer state sharded "
            "for an exact resume, and the adapter is gathered on its own (the base is never gathered)"
        )
    if setting("ACTIVATION_CHECKPOINTING", "false") == "true":
        raise RecipeError(
            "fsdp_activation_checkpointing: set it to false; memory.checkpointing is the one switch for "
            "checkpointing, and under FSDP2 it costs no extra all-gather (12 per step with and without it "
            "on the demo model), while FSDP's wrapper renames the LoRA parameters"
        )
    if setting("CPU_RAM_EFFICIENT_LOADING", "false") == "true":
        log.warning(
            "fsdp_cpu_ram_efficient_loading saves nothing with a 4-bit model: transformers loads a quantized "
            "model on every process (only unquantized ones on the first alone), and accelerate then "
            "broadcasts the first process's copy to the others; set it to false"
        )
