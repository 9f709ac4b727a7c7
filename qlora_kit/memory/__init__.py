"""The memory family: what a run keeps on the device and how qlora_kit decides and measures it.

- ``checkpointing``: the activation-checkpointing policy applied to the decoder layers;
- ``optimizers``: the optimizer registry (class, paged, 8-bit, state bytes, pageable threshold);
- ``loss_head``: the chunked, recomputed output head and loss;
- ``accounting``: bytes saved for backward, CUDA peaks per phase;
- ``monitor``: the Trainer callbacks that record them (and ``metrics.jsonl``);
- ``planner``: peak memory predicted from the model config alone, per policy.

Arrows: checkpointing -> planner -> optimizers; monitor -> accounting. Nothing here imports the
pipeline. Modules are imported by path (``from qlora_kit.memory import planner``): this file imports
nothing, so the recipe can read the optimizer registry without loading torch.
"""
