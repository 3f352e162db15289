"""The integer width of the kernels' index arithmetic, chosen once per plan.

A kernel forms element offsets as products (block id * block stride, slot * row stride,
head * head stride) and positions as sums (first position + tile row).  In int32 those
wrap silently past 2**31 - 1 and address memory outside the cache, so the width is chosen
from what the step can reach: int32 (cheaper registers on a GPU) only where every offset
into the layout's planes, every position and every token index fits; int64 otherwise.
Pure Python, so the choice is testable for layouts far too large to allocate.
"""
from __future__ import annotations

import numpy as np

from kvabi import KVABIError, UnsupportedError
from kvabi.util.coerce import INT32_MAX, index_array

#: headroom for a key tile past the last position (the kernels' largest BLOCK_N, rounded up)
POSITION_MARGIN = 1024


def plane_elements(layout) -> int:
    """Elements of one plane, padding included: every offset a [B, N, H, D] view of the
    layout forms from the plane's start is below this."""
    return -(-layout.plane_nbytes // layout.itemsize)


def extent(shape, strides) -> int:
    """One past the largest element offset of a strided view (0 when empty)."""
    if any(int(n) == 0 for n in shape):
        return 0
    return 1 + sum((int(n) - 1) * abs(int(s)) for n, s in zip(shape, strides))


def needs_int64(layout, *, max_seq_len: int = 0, num_tokens: int = 0,
                extents=()) -> bool:
    """Whether a step over ``layout`` needs int64 index arithmetic: a plane of more than
    2**31 - 1 elements, a position that a key tile can push past int32, a token index past
    int32, or a step tensor (query, output, new K/V) whose furthest offset exceeds it."""
    if plane_elements(layout) > INT32_MAX:
        return True
    if int(max_seq_len) + POSITION_MARGIN > INT32_MAX or int(num_tokens) > INT32_MAX:
        return True
    return any(int(e) > INT32_MAX for e in extents)


def tensor_extent(t) -> int:
    """:func:`extent` of a torch tensor (or anything with ``shape`` and ``stride()``)."""
    return extent(t.shape, t.stride())


def index_dtype(wide: bool):
    """numpy dtype of the index arrays a kernel loads (block table, lengths, tiles)."""
    return np.int64 if wide else np.int32


def library_int32(x, field: str, backend: str, *, ndim: int = 1) -> np.ndarray:
    """``x`` as int32 for a library that takes int32 indices (FlashInfer's CSR pages,
    flash-attn's block table and cumulative lengths); a value past int32 (a pool of more
    than 2**31 blocks, a step whose keys total more than 2**31 - 1) is UnsupportedError
    naming ``field``, never a wrapped index."""
    try:
        return index_array(x, field, np.int32, ndim=ndim)
    except KVABIError as e:
        raise UnsupportedError(f"{backend}: unsupported: {e} (the library takes int32 "
                               "indices)") from None
