"""Block ids, token slots and restorable prefixes: the arithmetic both sides of P/D share
(``specs/pd.md`` section 2), plain numpy, vectorized.

Block lists are per request and KV cache group, in the engine's own block ids; ``-1``
(:data:`NULL`) is the null block: a block the engine does not hold (e.g. wholly before a
sliding window), never addressed.  An engine whose own allocator uses another marker maps
it to ``-1`` where its block lists enter kvabi.
"""
from __future__ import annotations

import numpy as np

from ..util.errors import KVABIError

#: the null block of the protocol: no block
NULL = -1


def token_slots(blocks, block_size: int, start: int, num_tokens: int) -> np.ndarray:
    """Slots of positions ``start .. start + num_tokens - 1`` of a request whose block list
    is ``blocks`` (slot = block * block_size + position % block_size); -1 where the block is
    null or beyond the list."""
    blocks = np.asarray(blocks, np.int64).reshape(-1)
    pos = np.arange(start, start + num_tokens, dtype=np.int64)
    idx = pos // block_size
    inside = idx < blocks.size
    b = np.where(inside, blocks[np.minimum(idx, max(blocks.size - 1, 0))] if blocks.size
                 else NULL, NULL)
    return np.where(b < 0, -1, b * block_size + pos % block_size)


def paired_slots(src_blocks, src_bs: int, dst_blocks, dst_bs: int, start: int,
                 num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination slots of the tokens both sides hold (a token whose block is
    null on either side is left out: out of a sliding window, never read)."""
    s = token_slots(src_blocks, src_bs, start, num_tokens)
    d = token_slots(dst_blocks, dst_bs, start, num_tokens)
    keep = (s >= 0) & (d >= 0)
    return s[keep], d[keep]


def block_pairs(src, dst, block_size: int, start: int, num_tokens: int):
    """(source, destination) ids of the blocks holding positions ``start ..
    start + num_tokens - 1`` on both sides (equal block sizes; null on either side: left
    out).  Whole blocks move: slots past the last token hold nothing the destination reads
    before writing them itself."""
    lo, hi = start // block_size, -(-(start + num_tokens) // block_size)
    s, d = np.asarray(src[lo:hi], np.int64), np.asarray(dst[lo:hi], np.int64)
    n = min(s.size, d.size)
    s, d = s[:n], d[:n]
    keep = (s >= 0) & (d >= 0)
    return s[keep], d[keep]


def window_blocks(window, block_size: int) -> int | None:
    """Blocks a sliding-window group needs before a block boundary (None: all of them):
    the first token computed after it attends back ``window - 1`` tokens."""
    return None if not window else max(-(-(int(window) - 1) // block_size), 1)


def null_allowed(window, block_size: int, num_tokens: int) -> np.ndarray:
    """bool [ceil(num_tokens / block_size)]: where a producer may list the null block for a
    group of sliding window ``window`` (None: nowhere): blocks wholly before the window of
    the last prompt token, which the consumer computes itself."""
    want = -(-num_tokens // block_size)
    if not window:
        return np.zeros(want, bool)
    return np.arange(1, want + 1) * block_size <= num_tokens - int(window)


def usable_prefix(present: np.ndarray, needed_back: np.ndarray) -> int:
    """The longest prefix of blocks ``k`` that can be restored: ``present[g, i]`` says block
    ``i`` of group ``g`` is held, and group ``g`` needs its last ``needed_back[g]`` blocks
    before ``k`` (all ``k`` blocks for full attention: pass ``k`` or more)."""
    present = np.asarray(present, bool)
    if present.ndim != 2:
        raise KVABIError(f"present: must be [groups, blocks], got shape {present.shape}")
    g, n = present.shape
    if n == 0:
        return 0
    # missing[g, k] = blocks missing among the first k of group g (cumulative)
    missing = np.concatenate([np.zeros((g, 1), np.int64),
                              np.cumsum(~present, axis=1)], axis=1)
    k = np.arange(n + 1)
    lo = np.maximum(k[None, :] - np.asarray(needed_back, np.int64)[:, None], 0)
    ok = (missing[:, k] - missing[np.arange(g)[:, None], lo] == 0).all(axis=0)
    ok[0] = True
    return int(np.flatnonzero(ok).max())


__all__ = ["NULL", "block_pairs", "null_allowed", "paired_slots", "token_slots",
           "usable_prefix", "window_blocks"]
