"""Cache write by slot mapping in plain torch (index_put on strided views).

Used where a library has no cache-write op of its own (flash-attn), and as the fallback
the benchmark compares the Triton write with.
"""
from __future__ import annotations


def write_kv_torch(key, value, k_view, v_view, slots, block_size: int) -> None:
    """Scatter ``key`` [T, H, D] (and ``value``, or None) into the [B, N, H, D] views at
    ``slots`` (int64 tensor; -1 skipped).  Writes go through the views into the cache."""
    real = (slots >= 0).nonzero().squeeze(1)
    if real.numel() == 0:
        return
    s = slots.index_select(0, real)
    blk, off = s // block_size, s % block_size
    k_view[blk, off] = key.index_select(0, real).to(k_view.dtype)
    if value is not None:
        v_view[blk, off] = value.index_select(0, real).to(v_view.dtype)
