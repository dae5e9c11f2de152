"""transformers' own GGUF loading (the reference for the GGUF converters and tokenizers),
made fast enough for the test suite without changing what it reads or how it converts."""
from __future__ import annotations

import contextlib
import functools
import types

import numpy as np


@contextlib.contextmanager
def gguf_parsed_once_in_memory():
    """Inside the block, ``gguf.GGUFReader`` of one path is built once, from the file's bytes
    read into memory.

    - Once: transformers builds a new reader for the config, another for the weights and a
      third for the tokenizer, and each parses the whole vocabulary again.
    - In memory: the reader slices an ``np.memmap`` of the file millions of times (a few per
      vocabulary entry), each through the memmap subclass's Python ``__getitem__`` and
      ``__array_finalize__``; a plain array of the same bytes is sliced in C. Measured on this
      project's 2-core machine, Gemma 3's file (262,144 tokens): 26.7 s to parse from the
      memmap, 8.7 s from memory; SmolLM2's tokenizer 8.3 s against 3.7 s.

    - The tensor-name map of one (architecture, number of blocks) is built once: transformers
      asks ``gguf.get_tensor_name_map`` again for every submodule it walks (397 times for
      SmolLM2), and each call formats the names of every block anew (12 s of a 22 s load).

    gguf's and transformers' own code still parses, dequantises and converts everything."""
    import gguf
    import gguf.gguf_reader as reader_module
    real_reader, real_np = gguf.GGUFReader, reader_module.np
    file_in_memory = types.ModuleType("numpy_with_files_in_memory")
    file_in_memory.__dict__.update(real_np.__dict__)
    file_in_memory.memmap = _read_into_memory
    real_name_map = gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(real_reader)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real_name_map)
    reader_module.np = file_in_memory
    try:
        yield
    finally:
        gguf.GGUFReader = real_reader
        gguf.get_tensor_name_map = real_name_map
        reader_module.np = real_np


def _read_into_memory(path, mode: str = "r") -> np.ndarray:
    """The bytes of ``path`` as a read-only "uint8[size]" array, what ``np.memmap(path, mode="r")``
    gives the reader (its only mode here)."""
    if mode != "r":
        raise ValueError(f"gguf_parsed_once_in_memory reads files only (mode 'r'), got mode {mode!r}")
    data = np.fromfile(path, dtype=np.uint8)
    data.flags.writeable = False
    return data

