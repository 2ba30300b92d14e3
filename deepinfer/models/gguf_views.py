"""transformers reads a GGUF (its tokenizer, or the whole model for a reference) through gguf.GGUFReader, which
parses the header with one small numpy view per value of a np.memmap. The memmap subclass's Python hooks run for
every one of those views, and a vocabulary has hundreds of thousands of values: most of the time of opening the
file goes there (Gemma 3's tokenizer: 14.3 s to convert, 7.6 s with plain views). `plain_gguf_views()` gives the
reader a plain ndarray view of the same memory map: the same bytes, nothing read ahead, no hooks.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import numpy as np


class _PlainMemmapNumpy:
    """numpy, except that memmap(...) returns a plain ndarray view of the map (its base keeps the map open)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    @staticmethod
    def memmap(path: Any, mode: str = "r", **kwargs: Any) -> np.ndarray:
        return np.memmap(path, mode=mode, **kwargs).view(np.ndarray)


@contextlib.contextmanager
def plain_gguf_views() -> Iterator[None]:
    """Within the block, gguf.GGUFReader maps files as plain ndarrays. The exit puts numpy itself back (not
    whatever was there on entry), so overlapping uses from several threads cannot leave the stand-in behind; at
    worst a reader still open then parses at the ordinary speed."""
    try:
        import gguf.gguf_reader as reader
    except ImportError:  # no gguf: transformers cannot read the file either and says so itself
        yield
        return
    reader.np = _PlainMemmapNumpy()
    try:
        yield
    finally:
        reader.np = np
