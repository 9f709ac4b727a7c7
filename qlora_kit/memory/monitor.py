"""Trainer callbacks that record a run: ``metrics.jsonl`` and the memory figures of each logging step.

``MemoryMonitor`` gathers what ``accounting.py`` measures (bytes saved for backward on every training
forward pass; on CUDA the peak allocated memory of forward, backward and optimizer step, and the
device's used memory) and adds the largest since the last log to the Trainer's logs, so the
tensorboard callback and ``MetricsLog`` write them with the loss.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from qlora_kit.memory.accounting import OUTSIDE, PhasePeaks, SavedBytes
from qlora_kit.registries import metric_keys as keys
from qlora_kit.registries import objectives

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


class MetricsLog(TrainerCallback):
    """One JSON object per log event in metrics.jsonl: step, loss, eval_loss, lr, grad_norm, epoch, the
    memory figures (saved_mib, saved_mib_head, saved_mib_layers, CUDA peaks), the throughput
    (tokens_per_s, trained_tokens, mfu: throughput.py) and a mixture of experts' routing (aux_loss,
    max_load, idle, tokens_per_expert: training/expert_load.py)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self.attached: dict[str, Any] = {}  # figures for the next row that the Trainer's log cannot carry

    def attach(self, key: str, value: Any) -> None:
        """A figure for the next row that is no scalar (the experts' per-layer counts): kept out of the
        Trainer's log, whose trackers take scalars only."""
        self.attached[key] = value

    def record(self, row: dict[str, Any]) -> None:
        """An event of its own (an out-of-memory split: training/oom_recovery.py), not a log's figures."""
        self.rows.append(row)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs) -> None:
        if not state.is_world_process_zero or not logs:
            return
        row: dict[str, Any] = {"step": state.global_step}
        for key, name in keys.TRAINER_KEYS.items():
            value = logs.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                row[name] = float(value)
        objective_keys = objectives.logged_keys()  # every objective's TRL figures
        for key in [
            *objective_keys,
            *(f"eval_{k}" for k in objective_keys),
            *filter(keys.is_reward_key, logs),
        ]:
            value = logs.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                row[key] = float(value)
        if len(row) == 1:
            return  # end-of-training summaries carry none of the per-step keys
        row["epoch"] = round(float(state.epoch or 0.0), 4)
        layer = keys.MEMORY + keys.SAVED_MIB_LAYER
        layers = [v for k, v in sorted(logs.items()) if k.startswith(layer)]
        for key, value in logs.items():
            if key.startswith(keys.MEMORY) and not key.startswith(layer):
                row[key.removeprefix(keys.MEMORY)] = round(float(value), 4)
            elif key.startswith(keys.THROUGHPUT):
                row[key.removeprefix(keys.THROUGHPUT)] = round(float(value), 6)
            elif key.startswith(keys.EXPERTS):
                row[key.removeprefix(keys.EXPERTS)] = round(float(value), 6)
        if layers:
            row[keys.SAVED_MIB_LAYERS] = [round(float(v), 4) for v in layers]
        row.update(self.attached)
        self.attached = {}
        self.rows.append(row)
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")
