"""Watching a run: what it reports while it trains, and where.

- ``metrics_log``: ``metrics.jsonl``, one JSON object per log event (the memory monitor's figures come
  from memory/monitor.py);
- ``throughput``: tokens/s, trained tokens and MFU;
- ``trackers``: tensorboard, W&B, MLflow, trackio;
- ``expert_load``: a mixture of experts' routing (tokens per expert, the auxiliary loss, starved experts);
- ``run_console``: what a person watching the run sees;
- ``run_log``: what a run tells its user about itself (the setup before training, the memory after).

Modules are imported by path (``from qlora_kit.training.watch import trackers``); this file imports nothing.
"""
