"""Throughput in every run's ``metrics.jsonl``: tokens per second, trained tokens and model-FLOPs
utilisation (MFU), each logging step, so a throughput regression shows in every run, not only in
benchmarks.

Model FLOPs per token, for LoRA on a frozen base, counted from the model's own linear layers: the
forward pass does 2 FLOPs per weight of every linear layer and of the output head (N weights: 2N), the
backward pass 2N more for the input gradients and 2 per trained weight (LoRA's) for the weight
gradients (frozen weights get none). Attention adds 12 x width x sequence per token and layer for
forward and backward (width: heads x head size, read layer by layer; PaLM's accounting, appendix B, with
the row's length for the sequence). Recomputation by checkpointing is not counted: it is work the
hardware does, not the model, so MFU shows what checkpointing costs. ``tests/test_throughput.py`` checks the count against torch's FLOP counter.

MFU = model FLOPs per token x this process's tokens per second / the device's peak (``train.peak_tflops``,
or the table below for common GPUs; none on a CPU).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from qlora_kit.model import layer_sizes
from qlora_kit.model.layers import features, is_linear
from qlora_kit.registries import metric_keys as keys
from qlora_kit.registries.formats import IGNORE_INDEX
from qlora_kit.training.distributed import over_ranks

# Dense bf16 tensor-core peaks (fp16 on V100 and T4), TFLOPS per device, from the vendors' data sheets;
# the first name found in torch.cuda.get_device_name() wins.
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10": 125.0,
    "RTX 4090": 165.0,
    "V100": 125.0,
    "T4": 65.0,
}


def peak_tflops(configured: float | None) -> float | None:
    """The recipe's ``train.peak_tflops``, else this GPU's from the table; None when neither says."""
    if configured is not None:
        return configured
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def flops_per_token(model: torch.nn.Module, sequence: int) -> float:
    """Model FLOPs of one trained token in rows of ``sequence`` tokens (see the module docstring)."""
    return FlopsPerToken(model)(sequence)


class FlopsPerToken:
    """``flops_per_token`` with the model's shapes read once."""

    def __init__(self, model: torch.nn.Module) -> None:
        linears = [m for m in model.modules() if is_linear(m)]  # GPT-2's Conv1D projections too
        self.weights = sum(math.prod(features(m)) for m in linears)
        self.trained = sum(math.prod(features(m)) for m in linears if m.weight.requires_grad)
        config = model.config.get_text_config()  # a vision-language model's decoder
        # layer by layer: Gemma 4's full-attention layers have heads twice as wide as its sliding ones
        self.attention = 12 * config.num_attention_heads * sum(layer_sizes.head_dims(config))

    def __call__(self, sequence: int) -> float:
        return 4 * self.weights + 2 * self.trained + self.attention * sequence


class Throughput(TrainerCallback):
    """Counts the positions and the trained tokens of every training micro-batch (``count``, called by
    the Trainer subclass) and adds, at each log, ``throughput/tokens_per_s`` and
    ``throughput/trained_tokens`` (so far) over all processes, and ``throughput/mfu`` per device when
    a peak is known. One host read per log (the trained-token count stays on the device until then)."""

    def __init__(self, model: torch.nn.Module, peak: float | None) -> None:
        self.flops_per_token = FlopsPerToken(model)
        self.peak = peak * 1e12 if peak else None
        self.positions = 0  # since the last log
        self.flops = 0.0  # model FLOPs since the last log
        self.trained: torch.Tensor | None = None
        self.trained_so_far = 0
        self.started: float | None = None

    def count(self, inputs: dict[str, Any]) -> None:
        ids = inputs["input_ids"]
        self.positions += ids.numel()  # shapes only: no device sync
        self.flops += ids.numel() * self.flops_per_token(ids.shape[-1])
        labels = inputs.get("labels")
        if labels is not None:
            trained = (labels != IGNORE_INDEX).sum()
        elif (
            "completion_mask" in inputs
        ):  # DPO's pairs: both answers train (its reference forward is not counted)
            trained = inputs["completion_mask"].sum()
        else:
            trained = None
        if trained is not None:
            self.trained = trained if self.trained is None else self.trained + trained
        if self.started is None:
            self.started = time.perf_counter()

    def on_evaluate(self, args, state, control, **kwargs) -> None:
        self._restart()  # evaluation time is not training time

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs) -> None:
        # Every rank logs the loss at the same step, so the sums below meet on all of them.
        if logs is None or "loss" not in logs or self.started is None:
            return
        seconds = max(time.perf_counter() - self.started, 1e-9)
        trained = int(self.trained.item()) if self.trained is not None else 0  # the log's one host read
        totals = over_ranks(torch.tensor([self.positions, self.flops, trained], dtype=torch.float64))
        processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        positions, flops, trained_now = totals.tolist()
        self.trained_so_far += int(trained_now)
        logs[keys.THROUGHPUT + keys.TOKENS_PER_S] = positions / seconds
        logs[keys.THROUGHPUT + keys.TRAINED_TOKENS] = self.trained_so_far
        if self.peak:
            logs[keys.THROUGHPUT + keys.MFU] = flops / seconds / (self.peak * processes)
        self._restart()

    def _restart(self) -> None:
        self.positions, self.flops, self.trained, self.started = 0, 0.0, None, None
