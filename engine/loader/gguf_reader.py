"""gguf's GGUFReader with its fields read from a plain array over the mapped file.

GGUFReader slices every value of the header out of its np.memmap, and numpy runs the memmap subclass's
__array_finalize__ on each slice: about ten slices per token of the vocabulary and per merge (SmolLM2's 49k tokens
and 49k merges: ~1M slices). Slicing a plain ndarray view of the same mapping instead gives the same fields and
tensors (still views of the mapped file, read lazily) in about a quarter of the CPU time: 2.9 -> 0.8 CPU-seconds for
SmolLM2's file on a 2-core Xeon, the largest part of a replica's model load. Arrays (the vocabulary) then take
their elements' parts from that view in one pass (_get_field_parts). `_get` and `_get_field_parts` are the reader's
private methods we override (gguf is pinned in pyproject.toml); tests/engine/test_loader.py compares every field
and tensor with the stock reader's.
"""
from __future__ import annotations

import sys
from typing import Any, Literal

import gguf
import numpy as np
import numpy.typing as npt

ValueType = gguf.GGUFValueType


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

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[npt.NDArray[Any]], list[int],
                                                                         list[ValueType]]:
        """The stock reader's parts of an array of strings or scalars, each element's part(s) sliced straight from
        the plain view where the file's byte order is this CPU's. A vocabulary's tokens, token types and merges, read
        element by element through the generic path, were most of the header's parse: on a Zen 5, 0.50 -> 0.12 s
        for SmolLM2's file, 1.12 -> 0.23 s for a Llama 3.2 file's 128k tokens."""
        if ValueType(raw_type) != ValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, count, offs = ValueType(raw_itype[0]), int(alen[0]), orig_offs + 12
        parts: list[npt.NDArray[Any]] = [raw_itype, alen]
        scalar = self.gguf_scalar_to_np.get(itype)
        if itype == ValueType.STRING:
            plain, lengths = self._plain, np.uint64
            for _ in range(count):
                n = int.from_bytes(plain[offs:offs + 8], sys.byteorder)
                parts += (plain[offs:offs + 8].view(lengths), plain[offs + 8:offs + 8 + n])
                offs += 8 + n
            data = list(range(3, 2 + 2 * count, 2))
        elif scalar is not None:
            values = self._get(offs, scalar, count)
            parts += (values[i:i + 1] for i in range(count))
            offs += int(values.nbytes)
            data = list(range(2, 2 + count))
        else:  # arrays of arrays: the generic path
            return super()._get_field_parts(orig_offs, raw_type)
        types = [ValueType.ARRAY, itype] if count else [ValueType.ARRAY]  # as stock: the elements' type, if any
        return offs - orig_offs, parts, data, types
