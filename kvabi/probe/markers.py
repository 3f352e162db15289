"""Marker values: element ids spelled in values of the cache dtype.

Every element the probe writes carries its own id, so one read of the bytes says which
element landed where.  An element of the cache dtype holds one *digit* of the id: one of
``K`` bit patterns (the dtype's *alphabet*).  When the ids outnumber ``K`` (8-bit dtypes
hold ~240) the same elements are written again, once per further digit, and the digits
read back at each place are combined.

Alphabets use only patterns that survive any exact conversion an engine may make on the
way (to a wider float and back): finite, normal floats (no zeros, subnormals, NaN or
infinity, which a kernel may flush or canonicalise), and in int8 every value.  None is the
poison pattern (:data:`.memory.POISON` repeated).
"""
from __future__ import annotations

import functools

import attrs
import numpy as np

from ..util.dtypes import check_dtype, itemsize, numpy_dtype
from .memory import POISON

_F32_BASE = 0x3F800000  # 1.0: float32 digits are the floats in [1, 2), 2**23 of them


def _patterns(name: str) -> np.ndarray:
    """The alphabet of a dtype of at most 16 bits, as unsigned bit patterns."""
    bits = 8 * itemsize(name)
    p = np.arange(1 << bits, dtype=np.uint32)
    p = p[p != int.from_bytes(bytes([POISON]) * (bits // 8), "little")]
    if name == "int8":
        return p
    exp_bits, man_bits = {"float16": (5, 10), "bfloat16": (8, 7),
                          "float8_e4m3fn": (4, 3), "float8_e5m2": (5, 2)}[name]
    e = (p >> man_bits) & ((1 << exp_bits) - 1)
    ok = (e > 0) & (e < (1 << exp_bits) - 1)
    if name == "float8_e4m3fn":  # e4m3fn keeps the top exponent, all but its NaN
        ok = (e > 0) & ((p & 0x7F) != 0x7F)
    return p[ok]


@attrs.frozen
class Alphabet:
    """The digits of one dtype: ``size`` bit patterns and their inverse."""

    dtype: str
    size: int
    _table: np.ndarray | None = attrs.field(repr=False)  # digit -> pattern (<= 16 bits)
    _inverse: np.ndarray | None = attrs.field(repr=False)  # pattern -> digit or -1

    @classmethod
    @functools.lru_cache(maxsize=None)
    def of(cls, dtype: str) -> "Alphabet":
        check_dtype(dtype)
        if itemsize(dtype) == 4:
            return cls(dtype, 1 << 23, None, None)
        table = _patterns(dtype)
        inv = np.full(1 << (8 * itemsize(dtype)), -1, np.int64)
        inv[table] = np.arange(len(table))
        return cls(dtype, len(table), table, inv)

    def rounds(self, count: int) -> int:
        """Digits needed to give ``count`` elements distinct ids (writes per element)."""
        r, reach = 1, self.size
        while reach < count:
            r, reach = r + 1, reach * self.size
        return r

    def digit(self, ids: np.ndarray, r: int) -> np.ndarray:
        return (np.asarray(ids, np.int64) // self.size ** r) % self.size

    def values(self, digits: np.ndarray) -> np.ndarray:
        """Digits as an array of the cache dtype (numpy, ml_dtypes for bf16 and fp8)."""
        digits = np.asarray(digits, np.int64)
        isz = itemsize(self.dtype)
        if self._table is None:
            pat = (digits + _F32_BASE).astype(np.uint32)
        else:
            pat = self._table[digits].astype(np.dtype(f"u{isz}"))
        return pat.view(numpy_dtype(self.dtype))

    def decode(self, words: np.ndarray) -> np.ndarray:
        """Bit patterns read back (unsigned ints) -> digits, -1 where not a digit."""
        w = np.asarray(words).astype(np.int64)
        if self._table is None:
            d = w - _F32_BASE
            return np.where((d >= 0) & (d < self.size), d, -1)
        return self._inverse[w]
