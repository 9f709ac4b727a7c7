"""The run folder: what a run leaves on disk, and reading it back.

- ``outputs``: the output folder's policy (new, resume, overwrite; its lock) and atomic checkpoints;
- ``checkpoints``: a checkpoint staged whole and renamed into place, the best one recorded where it ends up,
  the final folder's adapter and tokenizer (the Trainer's save, resume's starting point);
- ``manifest``: what produced an adapter (``manifest.json``);
- ``run_record``: a run read back from its folder (``qlora-kit show``, the summary, the loss plot).

Modules are imported by path (``from qlora_kit.training.run_folder import outputs``); this file imports
nothing.
"""
