"""Watching a run: ``metrics.jsonl``, one JSON object per log event, written as the Trainer logs.

``MetricsLog`` is one of the run's callbacks (step/callbacks.py puts it after the memory
monitor, the throughput and the experts' routing, whose figures it writes); ``run_folder/run_record.py``
reads the file back.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from qlora_kit.registries import metric_keys as keys
from qlora_kit.registries import objectives


class MetricsLog(TrainerCallback):
    """One JSON object per log event in metrics.jsonl: step, loss, eval_loss, lr, grad_norm, epoch, the
    memory figures (saved_mib, saved_mib_head, saved_mib_layers, CUDA peaks), the throughput
    (tokens_per_s, trained_tokens, mfu: throughput.py) and a mixture of experts' routing (aux_loss,
    max_load, idle, tokens_per_expert: training/watch/expert_load.py)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self.attached: dict[str, Any] = {}  # figures for the next row that the Trainer's log cannot carry

    def attach(self, key: str, value: Any) -> None:
        """A figure for the next row that is no scalar (the experts' per-layer counts): kept out of the
        Trainer's log, whose trackers take scalars only."""
        self.attached[key] = value

    def record(self, row: dict[str, Any]) -> None:
        """An event of its own (an out-of-memory split: training/step/oom_recovery.py), not a log's figures."""
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
