"""How ``tpu.jax`` splits a step's attention work: query tiles bucketed by shape.

The shared plan cuts every request into tiles of one size, which on a host wastes most of
the work of a decode (one real row in a tile).  ``tpu.jax`` instead sorts requests into
buckets with their own tile height: decodes (one query token) as one-row tiles, everything
else in taller tiles.  Each bucket runs as one loop over its tiles, each tile reading only
its visible pages.  Built once per plan on the host with vectorized numpy and cached with
the plan, so every layer of the step reuses the device arrays.
"""
from __future__ import annotations

import weakref

import numpy as np

from .plan import (TILE_KVLEN, TILE_NPAGES, TILE_PAGE_LO, TILE_POS0, TILE_QLEN, TILE_REQ,
                   _expand, next_pow2)

_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def tile_bucket(reqs, rows: int, qsl, ctx, seq, spec, width: int | None = None):
    """Tiles of ``rows`` query tokens over requests ``reqs``: (tile_info int32 [6, W],
    q_index int32 [W * rows] (token in each tile row, 0 for empty rows), the tile row of
    each of the requests' tokens as (token ids, rows)); W ``width`` (the step's bucket) or
    else a power of two."""
    q = qsl[reqs + 1] - qsl[reqs]
    nt = -(-q // rows)
    k, i = _expand(nt)
    req = reqs[k]
    q0 = qsl[req] + i * rows
    qlen = np.minimum(rows, q[k] - i * rows)
    pos0 = ctx[req] + i * rows
    hi = pos0 + qlen  # keys j < hi
    lo = spec.first_visible_key(pos0)
    bs = spec.block_size
    page_lo = lo // bs
    w = len(req)
    wpad = next_pow2(max(w, 1)) if width is None else width
    info = np.zeros((6, wpad), np.int32)
    for row, val in ((TILE_REQ, req), (TILE_POS0, pos0), (TILE_QLEN, qlen),
                     (TILE_KVLEN, seq[req]), (TILE_PAGE_LO, page_lo),
                     (TILE_NPAGES, -(-hi // bs) - page_lo)):
        info[row, :w] = val
    r = np.arange(rows, dtype=np.int64)
    valid = r[None, :] < qlen[:, None]
    qi = np.zeros((wpad, rows), np.int64)
    qi[:w] = np.where(valid, q0[:, None] + r[None, :], 0)
    tile_rows = np.arange(wpad * rows).reshape(wpad, rows)[:w]
    return info, qi.reshape(-1).astype(np.int32), (qi[:w][valid], tile_rows[valid])


def buckets(plan, *, prefill_rows: int, to_device):
    """(static description ``((rows, num_tiles), ...)``, device arrays ``(out_index,
    tile_info, q_index, ...)``) of ``plan``'s attention, cached per plan.

    ``out_index[t]`` is the row of token ``t``'s output in the buckets' outputs
    concatenated (0 for padding tokens)."""
    key = (prefill_rows,)
    hit = _CACHE.get(plan, {}).get(key)
    if hit is not None:
        return hit
    meta, spec = plan.meta, plan.spec
    qsl = meta.query_start_loc.astype(np.int64)
    ctx = meta.context_lens.astype(np.int64)
    seq = meta.seq_lens.astype(np.int64)
    q = np.diff(qsl)
    decode = np.nonzero(q == 1)[0]
    other = np.nonzero(q > 1)[0]
    out_index = np.zeros(plan.prepared.padded_tokens, np.int32)
    static, arrays, base = [], [], 0
    b = plan.prepared.bucket  # bucketed: both kinds of tile always, at the bucket's widths
    for reqs, rows, width in ((decode, 1, b and b.decode_tiles),
                              (other, prefill_rows, b and b.prefill_tiles)):
        if not len(reqs) and b is None:
            continue
        info, qi, (tok, row) = tile_bucket(reqs, rows, qsl, ctx, seq, spec, width)
        out_index[tok] = base + row
        static.append((rows, info.shape[1]))
        arrays += [to_device(info), to_device(qi)]
        base += info.shape[1] * rows
    out = (tuple(static), (to_device(out_index), *arrays))
    _CACHE.setdefault(plan, {})[key] = out
    return out
