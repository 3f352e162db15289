"""The per-step plan of the TPU backends: query tiles, page ranges and update slices.

Built once per step and KV group from :class:`kvabi.CommonAttentionMetadata` with vectorized
numpy, then moved to the device once; every layer of the group reuses it.

Attention work is cut into *tiles*: up to ``tile_size`` consecutive query tokens of one
request.  Each tile records the key pages it can see (a sliding window or attention chunk
narrows the range), so a kernel reads only those pages.  Tile arrays are padded to a power
of two so that steps of similar size share one compiled kernel.
"""
from __future__ import annotations

import attrs
import numpy as np

import kvabi

#: rows of TPUPlan.tile_info
TILE_REQ, TILE_POS0, TILE_QLEN, TILE_KVLEN, TILE_PAGE_LO, TILE_NPAGES = range(6)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _expand(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(group, index within group) of every element of groups of sizes ``counts``."""
    owner = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    return owner, np.arange(len(owner), dtype=np.int64) - starts[owner]


@attrs.frozen(eq=False)
class TPUPlan:
    """Device-side description of one step, shared by ``write_kv`` and ``attention``."""

    meta: kvabi.CommonAttentionMetadata
    spec: kvabi.KVSpec
    layout: object
    fmt: object
    scale: float
    softcap: float | None
    #: float32 numpy [Hq] logits of the attention sinks, or None
    sinks: np.ndarray | None
    tile_size: int
    #: tiles that hold real queries (the rest of the padded arrays are empty tiles)
    num_tiles: int
    #: int32 [6, W]: request, first query position, query count, kv length, first page
    #: (index into the request's block table row), page count; W a power of two
    tile_info: object
    #: int32 [R, P] block table padded to powers of two (entries past a request's pages: 0)
    page_table: object
    #: int32 [W * tile_size]: token gathered into each tile row
    q_index: object
    #: int32 [padded_tokens]: tile row holding each token's output (0 for padding)
    out_index: object
    #: int32 [3, S] update slices (cache slot, token, length) and [1] their count
    slices: object
    num_slices: object
    #: the largest page count of one tile, rounded up to a power of two
    max_tile_pages: int
    #: int32 [padded_tokens] cache slot of each token, -1 for padding
    slots: object
    #: num_tokens rounded up to a power of two: queries and new K/V are padded to this
    #: many rows so that steps of similar size share one compiled computation
    padded_tokens: int


def build_plan(meta, spec, layout, fmt, *, scale=None, softcap=None, sinks=None,
               tile_size: int, num_slices_per_block: int, to_device) -> TPUPlan:
    """Compute the plan of one step (see :class:`TPUPlan`); ``to_device`` maps numpy
    arrays to the backend's device arrays."""
    kvabi.check_step(meta, spec, layout)
    opts = kvabi.AttentionOptions.resolve(spec, scale, softcap, sinks)
    scale, softcap = opts.scale, opts.softcap
    sinks = None if opts.sinks is None else opts.sinks.astype(np.float32)
    bs = spec.block_size

    qsl = meta.query_start_loc.astype(np.int64)
    q = np.diff(qsl)
    c = meta.context_lens.astype(np.int64)
    s = meta.seq_lens.astype(np.int64)
    need = -(-s // bs)
    bt = meta.block_table
    used = np.arange(bt.shape[1])[None, :] < need[:, None]

    # -- tiles ---------------------------------------------------------------------------
    nt = -(-q // tile_size)
    req, i = _expand(nt)
    w = len(req)
    q0 = qsl[req] + i * tile_size
    qlen = np.minimum(tile_size, q[req] - i * tile_size)
    pos0 = c[req] + i * tile_size
    hi = pos0 + qlen  # one past the last query position: keys j < hi
    lo = spec.first_visible_key(pos0)
    page_lo = lo // bs
    npages = -(-hi // bs) - page_lo
    wpad = next_pow2(max(w, 1))
    info = np.zeros((6, wpad), np.int32)
    for row, val in ((TILE_REQ, req), (TILE_POS0, pos0), (TILE_QLEN, qlen),
                     (TILE_KVLEN, s[req]), (TILE_PAGE_LO, page_lo), (TILE_NPAGES, npages)):
        info[row, :w] = val

    r = np.arange(tile_size, dtype=np.int64)
    qi = np.zeros((wpad, tile_size), np.int32)
    qi[:w] = np.where(r[None, :] < qlen[:, None], q0[:, None] + r[None, :], 0)
    total = int(qsl[-1])
    padded_tokens = next_pow2(max(1, meta.num_tokens))
    out_index = np.zeros(padded_tokens, np.int32)
    if total:
        treq = np.repeat(np.arange(len(q)), q)
        local = np.arange(total) - qsl[treq]
        tile_base = np.cumsum(nt) - nt
        out_index[:total] = (tile_base[treq] + local // tile_size) * tile_size + \
            local % tile_size

    nreq = max(1, bt.shape[0])
    ncol = next_pow2(max(1, bt.shape[1]))
    table = np.zeros((next_pow2(nreq), ncol), np.int32)
    if bt.size:
        table[:bt.shape[0], :bt.shape[1]] = np.where(used, bt, 0)

    # -- cache update slices -------------------------------------------------------------
    slices, n = kvabi.transforms.kv_update_slices(meta, num_slices_per_block)
    per = num_slices_per_block
    padded = next_pow2(slices.shape[1] // per) * per
    sl = np.zeros((3, padded), np.int32)
    sl[:, :slices.shape[1]] = slices

    slots = np.full(padded_tokens, -1, np.int32)
    slots[:meta.num_tokens] = meta.slot_mapping
    return TPUPlan(meta, spec, layout, fmt, scale, softcap, sinks, tile_size, w,
                   to_device(info), to_device(table), to_device(qi.reshape(-1)),
                   to_device(out_index), to_device(sl), to_device(np.array([n], np.int32)),
                   next_pow2(max(1, int(npages.max(initial=1)))),
                   to_device(slots), padded_tokens)
