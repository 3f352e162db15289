"""Chunked local attention (Llama 4 iRoPE) as plain causal attention over virtual requests.

With attention chunk C a query at position p sees only keys of its own chunk
``[C * floor(p / C), p]``.  Splitting every request into one virtual request per chunk its
queries touch, with positions and block table rebased to the chunk's start, turns that into
ordinary causal attention that any backend computes.
"""
from __future__ import annotations

import numpy as np

from ..step.metadata import CommonAttentionMetadata
from ..util.errors import require
from ._common import assemble, check_int, check_meta, expand, query_bounds


def local_virtual_batches(meta: CommonAttentionMetadata, chunk: int
                          ) -> tuple[CommonAttentionMetadata, np.ndarray]:
    """Split each request into virtual requests, one per attention chunk its queries touch.

    ``chunk`` must be a positive multiple of ``meta.block_size``.  Virtual request v of real
    request r covering chunk k has the queries of r at positions ``[kC, (k+1)C)``, context
    ``max(c, kC) - kC`` and block table row ``block_table[r, kC/block_size:]`` (zero-filled
    on the right).  Query tokens keep their order and slots, so outputs line up 1:1 with
    ``meta``'s tokens; padding tokens stay padding.  Requests with no query tokens get no
    virtual request.  Returns ``(meta2, virtual_to_request)`` (int64, one entry per virtual
    request).  Full causal attention over ``meta2`` equals chunked local attention over
    ``meta``.
    """
    meta = check_meta(meta)
    chunk = check_int(chunk, "chunk", lo=1)
    bs = meta.block_size
    require(chunk % bs == 0, "chunk", f"must be a multiple of block_size {bs}", chunk)
    q, c, s, qsl = query_bounds(meta)
    first = c // chunk
    count = np.where(q > 0, (s - 1) // chunk - first + 1, 0)
    vreq, i = expand(count)
    k = first[vreq] + i  # chunk index of each virtual request
    lo = k * chunk
    start = np.maximum(c[vreq], lo)
    end = np.minimum(s[vreq], lo + chunk)
    # Block table rows rebased to the chunk's first block: one row gather from a sliding
    # window over the flat table.  Columns past the real table are never needed (seq_len
    # fits) and are zero-filled; only rows whose window passes the table's end (the last
    # chunk of a long request) are rebuilt with a mask.
    bt = meta.block_table
    nr, nc = bt.shape
    width = min(chunk // bs, nc)
    col0 = lo // bs
    if len(vreq):
        windows = np.lib.stride_tricks.sliding_window_view(bt.reshape(-1), width)
        bt2 = windows[np.minimum(vreq * nc + col0, nr * nc - width)]
        spill = np.nonzero(col0 + width > nc)[0]
        if len(spill):
            cols = col0[spill, None] + np.arange(width)
            inside = cols < nc
            bt2[spill] = np.where(inside, bt[vreq[spill, None], np.where(inside, cols, 0)], 0)
    else:
        bt2 = np.zeros((0, width), bt.dtype)
    total = int(qsl[-1])
    pos = meta.positions.copy()
    pos[:total] -= np.repeat(lo, end - start)
    meta2 = assemble(meta, end - start, start - lo, bt2, pos, meta.slot_mapping)
    return meta2, vreq
