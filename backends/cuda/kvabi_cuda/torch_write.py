"""Cache write by slot mapping in plain torch (index_put on strided views).

Used where a library has no cache-write op of its own (flash-attn), and as the fallback
the benchmark compares the Triton write with.  The rows a step writes are computed once
per step (:func:`write_rows`), so a layer's write is two index_puts, without a host sync.
"""
from __future__ import annotations

import numpy as np


def write_rows(slot_mapping, block_size: int):
    """(real token indices, their blocks, their rows in the block) as int64 numpy arrays:
    the tokens whose slot is not -1 (padding)."""
    slots = np.asarray(slot_mapping, np.int64)
    real = np.nonzero(slots >= 0)[0]
    s = slots[real]
    return real, s // block_size, s % block_size


def write_kv_torch(key, value, k_view, v_view, rows) -> None:
    """Scatter ``key`` [T, H, D] (and ``value``, or None) into the [B, N, H, D] views at
    ``rows`` (:func:`write_rows`, as tensors on the views' device).  Writes go through the
    views into the cache."""
    real, blk, off = rows
    if real.numel() == 0:
        return
    k_view[blk, off] = key.index_select(0, real).to(k_view.dtype)
    if value is not None:
        v_view[blk, off] = value.index_select(0, real).to(v_view.dtype)
