"""One parse of a GGUF file for all that transformers reads from it (model/pretrained.py's conversion of the
real model, the parity report's transformers reader of an export).

transformers' GGUF loading (modeling_gguf_pytorch_utils.load_gguf_checkpoint) makes a new
``gguf.GGUFReader`` for the config, for the tokenizer and for the weights, and each parses every field of
the file: the real model's 49,152-token vocabulary and its merges are ~2.5 s of CPU a parse. Its weights'
name map (get_gguf_hf_weights_map) builds gguf's ``TensorNameMap`` again for each of the model's ~400
modules, ~7 ms each. Inside ``parsed_once`` the readers are kept per file and the name maps per
architecture and layer count: the same objects, read the same way, made once.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, one ``GGUFReader`` per file (its path, size and modification time) and one tensor
    name map per (architecture, layers); both are looked up on the ``gguf`` module at each call
    (load_gguf_checkpoint and get_gguf_hf_weights_map import them inside the function), so the block
    replaces them there and puts the originals back after it."""
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple, object] = {}

    def reader(path, mode: str = "r"):
        stat = os.stat(path)
        key = (os.fspath(path), stat.st_size, stat.st_mtime_ns, mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
