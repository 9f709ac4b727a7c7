"""The pieces of out-of-memory recovery (training/step/oom_recovery.py) that need no Trainer, one concern a
module:

- ``policy``: the recipe's policy (``train.on_oom``, ``train.probe_worst_batch``): ``OomPolicy``, its
  levers and the planner's prediction for a stop;
- ``rows``: a micro-batch cut into parts of its rows, its rows, width and tokens, parts put back together;
- ``autocast_state``: torch's autocast state, kept across an attempt that fails inside accelerate's autocast;
- ``random_state``: every random state a step draws from, taken and put back for a redo;
- ``split_file``: ``micro_batch_split.json``, the parts a checkpoint was written with;
- ``failure``: what a failed attempt leaves: its text, the memory released and its figures, the split's
  ``metrics.jsonl`` row and the stop's one line.

Modules are imported by path (``from qlora_kit.training.step.oom import rows``); this file imports nothing.
"""
