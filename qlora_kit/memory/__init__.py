"""The memory family: what a run keeps on the device and how qlora_kit decides and measures it.

- ``checkpointing``: the activation-checkpointing policy applied to the decoder layers;
- ``optimizers``: building the recipe's optimizer, its state report, re-paging after a resume (which
  optimizers exist is ``registries/optimizers``);
- ``loss_head``: the chunked, recomputed output head and loss;
- ``accounting``: bytes saved for backward, CUDA peaks per phase;
- ``monitor``: the Trainer callbacks that record them (and ``metrics.jsonl``);
- ``shapes``: a model's shapes and weight bytes from its config alone;
- ``tracing``: the bytes each decoder layer keeps, traced on fake tensors through the run's own code;
- ``planner``: peak memory predicted per policy, and ``checkpointing: auto`` resolved from it;
- ``oom_faults``: a fault injector that raises a real out-of-memory error past a cap (tests, CPU).

Arrows: planner -> tracing -> checkpointing -> accounting; monitor -> accounting -> oom_faults. Modules are imported by
path (``from qlora_kit.memory import planner``); this file imports nothing.
"""
