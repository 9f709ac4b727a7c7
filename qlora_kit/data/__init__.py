"""The data family: rows in, tokenized (and packed) training and validation sets out.

- ``formats``: the format registry (fields, rendering with trained segments, the prompt for generation);
- ``sources``: loading a source's rows through ``datasets`` (files, shard folders, the hub, builtin);
- ``prepare``: tokenizing, the length policy, the split, mixing sources, collators;
- ``preflight``: the checks that stop a run whose data trains on nothing;
- ``packing``: best-fit packing of examples into rows, and the packed-row collator;
- ``errors``: ``DataError`` and the diagnosis of a file that does not load;
- ``report``: what ``qlora-kit data`` shows.

Modules are imported by path (``from qlora_kit.data import prepare``): this file imports nothing, so the
recipe can read the format registry without loading ``datasets``.
"""
