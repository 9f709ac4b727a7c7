"""What one process of a multi-process run (``accelerate launch``, torchrun) does differently.

Every rank loads the 4-bit model onto its own device and trains its shard of each batch; the Trainer
(through accelerate) all-reduces the gradients. Only the main process touches the output folder:
the lock, the checks, the manifest, logs, checkpoints' shared files and the final adapter. The others
wait at barriers. A single process is the same code with one rank.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from accelerate import PartialState


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
        return flag
    value = torch.tensor([1 if flag else 0], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def launched_with_fsdp() -> bool:
    """accelerate sets this for a run launched with an FSDP config."""
    return os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
