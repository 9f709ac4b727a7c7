"""The Trainer and its step: transformers' Trainer with what qlora_kit adds to each step of a run.

- ``trainer``: ``GuardedTrainer``, the subclass every objective's Trainer builds on: one training step
  in the order it runs, as code, and the objects it calls;
- ``arguments``: the Trainer's arguments from the recipe;
- ``callbacks``: every callback of a run, in order;
- ``private_hooks``: the private Trainer and TRL methods overridden, why, and a check at import;
- ``guards``: stop a run that trains nothing or on garbage;
- ``interrupts``: a signal -> a checkpoint;
- ``oom_recovery``: ``OomRecovery``, the object the step calls: an out-of-memory error in a step splits
  the micro-batch and keeps the global batch;
- ``oom/``: the pieces of that recovery that need no Trainer, one concern a module (the recipe's policy,
  a micro-batch's rows cut in parts, the autocast and random states, the split file, a failure's figures
  and messages).

What one process of several does differently (DDP, FSDP2) is ``training/distributed.py``, which the step
and what watches it (``watch/``) both read.

Modules are imported by path (``from qlora_kit.training.step import trainer``); this file imports nothing.
"""
