"""The Trainer callback that records a run's memory figures at each logging step.

``MemoryMonitor`` gathers what ``accounting.py`` measures (bytes saved for backward on every training
forward pass; on CUDA the peak allocated memory of forward, backward and optimizer step, and the
device's used memory) and adds the largest since the last log to the Trainer's logs, so the
tensorboard callback and ``MetricsLog`` (training/watch/metrics_log.py) write them with the loss.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import TrainerCallback

from qlora_kit.memory.accounting import OUTSIDE, PhasePeaks, SavedBytes
from qlora_kit.registries import metric_keys as keys

MIB = 1024**2


class MemoryMonitor(TrainerCallback):
    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.window: list[SavedBytes] = []  # since the last log
        self.largest: SavedBytes | None = None  # over the whole run
        self.peaks = PhasePeaks()
        self.run_peaks = PhasePeaks()
        self.first_forward: float | None = None
        self.last_backward: float | None = None

    # Called by the Trainer subclass around each training forward and backward pass.
    def phase_started(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def forward_started(self) -> None:
        """Training time runs from the first forward to the last backward (tokens/s is Throughput's)."""
        if self.first_forward is None:
            self.first_forward = time.perf_counter()

    def forward_done(self, saved: SavedBytes) -> None:
        self.window.append(saved)
        if self.largest is None or saved.total > self.largest.total:
            self.largest = saved
        if self.cuda:
            self.peaks.forward = max(self.peaks.forward, torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    def backward_done(self) -> None:
        self.last_backward = time.perf_counter()
        if self.cuda:
            self.peaks.backward = max(self.peaks.backward, torch.cuda.max_memory_allocated())

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        self.phase_started()

    def on_optimizer_step(self, args, state, control, **kwargs) -> None:
        if self.cuda:
            self.peaks.optimizer = max(self.peaks.optimizer, torch.cuda.max_memory_allocated())
            free, total = torch.cuda.mem_get_info()
            # Paged optimizer state is managed memory: only the device's own count sees it.
            self.peaks.device_used = max(self.peaks.device_used, total - free)

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs) -> None:
        if logs is None or not self.window:
            return
        biggest = max(self.window, key=lambda saved: saved.total)
        self.window.clear()
        logs[keys.MEMORY + keys.SAVED_MIB] = biggest.total / MIB
        logs[keys.MEMORY + keys.SAVED_MIB_HEAD] = biggest.per_layer.get(OUTSIDE, 0) / MIB
        for name, nbytes in sorted(biggest.per_layer.items()):
            if name != OUTSIDE:
                logs[f"{keys.MEMORY}{keys.SAVED_MIB_LAYER}{int(name.split()[-1]):03d}"] = nbytes / MIB
        if self.cuda:
            logs.update({keys.MEMORY + k: v for k, v in self.peaks.as_dict().items()})
            for phase in ("forward", "backward", "optimizer", "device_used"):
                setattr(
                    self.run_peaks, phase, max(getattr(self.run_peaks, phase), getattr(self.peaks, phase))
                )
            self.peaks = PhasePeaks()

    def summary(self) -> dict[str, Any]:
        """The run's largest figures: saved bytes (total, head, per layer) and, on CUDA, phase peaks."""
        if self.largest is None:
            return {}
        layers = [v for k, v in sorted(self.largest.per_layer.items()) if k != OUTSIDE]
        result: dict[str, Any] = {
            keys.SAVED_MIB: self.largest.total / MIB,
            keys.SAVED_MIB_HEAD: self.largest.per_layer.get(OUTSIDE, 0) / MIB,
            keys.SAVED_MIB_LAYERS: [v / MIB for v in layers],
        }
        if self.first_forward is not None and self.last_backward is not None:
            seconds = max(self.last_backward - self.first_forward, 1e-9)
            result[keys.TRAIN_SECONDS] = seconds
        if self.cuda:
            result |= self.run_peaks.as_dict()
        return result
