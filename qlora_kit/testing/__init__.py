"""The tests' machinery that benchmarks and other processes need too, kept out of the run's code: no
module of the package outside this one imports it (tests/test_architecture.py).

- ``fault_seam``'s faults (``faults``): ``install()`` puts the injectors below in force through the one
  seam a run has for them (memory/fault_seam.py); ``__main__``: ``python -m qlora_kit.testing ARGS``,
  ``qlora-kit ARGS`` with them installed (a run under torchrun);
- ``oom_faults``: a real ``torch.OutOfMemoryError`` past a cap on the bytes saved for backward, a
  recompute's, evaluation's or generation's live bytes;
- ``allocator_faults``: an out-of-memory error from the allocation path, counted as CUDA's allocator
  counts, and what each retry finds still allocated;
- ``model_state``: what a run applied to a model, read back (offloaded checkpoints, tiled MLPs), and
  bitsandbytes' own 4-bit kernel given back.

Modules are imported by path (``from qlora_kit.testing import faults``); this file imports nothing.
"""
