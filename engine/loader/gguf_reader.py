"""gguf's GGUFReader with its fields read from a plain array over the mapped file.

GGUFReader slices every value of the header out of its np.memmap, and numpy runs the memmap subclass's
__array_finalize__ on each slice: about ten slices per token of the vocabulary and per merge (SmolLM2's 49k tokens
and 49k merges: ~1M slices). Slicing a plain ndarray view of the same mapping instead gives the same fields and
tensors (still views of the mapped file, read lazily) in about a quarter of the CPU time: 2.9 -> 0.8 CPU-seconds for
SmolLM2's file on a 2-core Xeon, the largest part of a replica's model load. `_get` is the reader's one
private method we override (gguf is pinned in pyproject.toml); tests/engine/test_loader.py compares every field and
tensor with the stock reader's.
"""
from __future__ import annotations

from typing import Any, Literal

import gguf
import numpy as np
import numpy.typing as npt


class GGUFReader(gguf.GGUFReader):
    """gguf.GGUFReader(path, mode), its header parsed from a plain ndarray view of self.data (the np.memmap)."""

    def _get(self, offset: int, dtype: npt.DTypeLike, count: int = 1,
             override_order: None | Literal["I", "S", "<"] = None) -> npt.NDArray[Any]:
        plain = self.__dict__.get("_plain")
        if plain is None:  # the first read: __init__ has just mapped the file into self.data
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        dtype = np.dtype(dtype)
        arr = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))
