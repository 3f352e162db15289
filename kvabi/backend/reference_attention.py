"""The reference backend's attention math: padded, batched, float64.

Each request's query tokens are cut into *pieces* of at most ``query_piece`` consecutive
tokens; a piece is padded to a power-of-two width and only looks at the key positions its
tokens can possibly see (``key0 .. key0 + nkeys - 1``: everything up to the last token for
full attention, the window or chunk otherwise).  Pieces of one width, sorted by key count, are
processed in bounded chunks: gather keys and values by block table into ``[v, S, H, D]``,
batched matmul for the logits ``[v, H, width*g, S]``, mask from positions, written-out
softmax with sinks, batched matmul for the output.  Python loops run over widths and chunks
only, never over tokens or requests.

Everything that depends on the step alone (pieces, chunk bounds, token rows, cache rows,
masks) is a :class:`ChunkWork`, built once per plan and query head count; a layer's call only
gathers its cache rows and does the arithmetic.
"""
from __future__ import annotations

import attrs
import numpy as np

#: a plan keeps its chunks' index arrays up to about this many elements (else per call)
WORK_KEEP_ELEMENTS = 1 << 22
#: masks up to this many elements per plan are kept; larger ones are rebuilt per call
MASK_KEEP_ELEMENTS = 1 << 22


@attrs.frozen(eq=False)
class Pieces:
    """Query pieces of one step, sorted by (width, nkeys); all arrays have one entry per
    piece: request, first token, token count, padded width, first key position, key count."""

    req: np.ndarray
    start: np.ndarray
    length: np.ndarray
    width: np.ndarray
    key0: np.ndarray
    nkeys: np.ndarray

    @classmethod
    def from_meta(cls, meta, spec, query_piece: int) -> "Pieces":
        ql = meta.query_lens.astype(np.int64)
        qsl = meta.query_start_loc.astype(np.int64)
        ctx = meta.context_lens.astype(np.int64)
        count = -(-ql // query_piece)
        req = np.repeat(np.arange(len(ql), dtype=np.int64), count)
        k = np.arange(len(req), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        start = qsl[req] + k * query_piece
        length = np.minimum(query_piece, qsl[req + 1] - start)
        pos0 = ctx[req] + k * query_piece
        key0 = spec.first_visible_key(pos0)
        nkeys = pos0 + length - key0  # up to the piece's last (causal) position
        width = np.left_shift(1, np.ceil(np.log2(np.maximum(length, 1))).astype(np.int64))
        order = np.lexsort((nkeys, width))
        return cls(*(a[order] for a in (req, start, length, width, key0, nkeys)))


def _chunks(pieces: Pieces, per_key: int, per_query_key: int, budget: int):
    """Yield (index array, width, keys) chunks of pieces whose arrays fit ``budget`` elements."""
    widths = pieces.width
    if not len(widths):
        return
    bounds = np.flatnonzero(np.diff(widths)) + 1
    for lo, hi in zip(np.r_[0, bounds], np.r_[bounds, len(widths)]):
        lo, hi = int(lo), int(hi)
        w = int(widths[lo])
        nk = pieces.nkeys[lo:hi]  # ascending: a chunk's widest piece is its last
        cost = per_key + w * per_query_key
        i = lo
        while i < hi:
            # Largest end e with (e - i) pieces * nkeys[e - 1] keys * cost <= budget.
            fits = np.arange(1, hi - i + 1) * nk[i - lo:] * cost <= budget
            e = i + max(1, int(np.searchsorted(~fits, True)))
            yield np.arange(i, e), w, int(nk[e - 1 - lo])
            i = e


@attrs.frozen(eq=False)
class ChunkWork:
    """The step-only part of one chunk of pieces: ``v`` pieces of width ``w`` over ``s``
    keys.  ``tok`` [v, w] query rows; ``rows`` the real (piece, column) entries and
    ``out_rows`` their tokens; ``blk``/``off`` [v, s] cache rows of the keys; ``mask``
    [v, w, s] which key each query sees (None when too large to keep: see
    :meth:`visible`)."""

    v: int
    w: int
    s: int
    tok: np.ndarray
    rows: np.ndarray
    out_rows: np.ndarray
    blk: np.ndarray
    off: np.ndarray
    pos: np.ndarray
    j: np.ndarray
    kvalid: np.ndarray
    tvalid: np.ndarray
    mask: np.ndarray | None

    def visible(self, spec) -> np.ndarray:
        """The [v, w, s] visibility mask (semantics section 3)."""
        if self.mask is not None:
            return self.mask
        return _mask(spec, self.j, self.pos, self.kvalid, self.tvalid)


def _mask(spec, j, pos, kvalid, tvalid):
    mask = (j[:, None, :] <= pos[:, :, None]) & kvalid[:, None, :] & tvalid[:, :, None]
    if spec.kind == "sliding_window":
        mask &= j[:, None, :] > pos[:, :, None] - spec.window
    elif spec.kind == "chunked_local":
        mask &= j[:, None, :] // spec.chunk == pos[:, :, None] // spec.chunk
    return mask


def step_work(meta, spec, pieces: Pieces, num_q_heads: int, budget: int):
    """The chunks of a step for ``num_q_heads`` query heads, each under ``budget`` float64
    elements, with everything that does not depend on the layer precomputed: a list of
    :class:`ChunkWork` when their index arrays fit :data:`WORK_KEEP_ELEMENTS` (every small
    step, decodes above all), else an iterable that builds each chunk per call, so a plan
    for a long prefill holds no more than that."""
    h, d, dv = spec.num_kv_heads, spec.head_dim, spec.head_dim_v
    per_key = h * (d + (0 if spec.is_mla else dv))
    bounds = list(_chunks(pieces, per_key, 3 * num_q_heads, budget))
    size = sum(len(idx) * (3 * w + 4 * s) for idx, w, s in bounds)
    if size > WORK_KEEP_ELEMENTS:
        return _PerCall(meta, spec, pieces, bounds)
    out, kept = [], 0
    for idx, w, s in bounds:
        keep_mask = kept + len(idx) * w * s <= MASK_KEEP_ELEMENTS
        c = _chunk_work(meta, spec, pieces, idx, w, s, keep_mask)
        kept += 0 if c.mask is None else c.mask.size
        out.append(c)
    return out


@attrs.frozen(eq=False)
class _PerCall:
    """Chunks built on each iteration (a step too large to keep them)."""

    meta: object
    spec: object
    pieces: Pieces
    bounds: list

    def __iter__(self):
        for idx, w, s in self.bounds:
            yield _chunk_work(self.meta, self.spec, self.pieces, idx, w, s, False)


def _chunk_work(meta, spec, pieces, idx, w, s, keep_mask: bool) -> ChunkWork:
    bs = spec.block_size
    r = pieces.req[idx]
    seq = meta.seq_lens[r].astype(np.int64)
    # Query tokens [v, w]; padding columns of a piece repeat its first token.
    col = np.arange(w, dtype=np.int64)
    tvalid = col[None, :] < pieces.length[idx][:, None]
    tok = np.where(tvalid, pieces.start[idx][:, None] + col[None, :],
                   pieces.start[idx][:, None])
    pos = meta.positions[tok]
    # Key positions [v, s] and their cache rows; rows past seq_len read block 0 row 0.
    j = pieces.key0[idx][:, None] + np.arange(s, dtype=np.int64)[None, :]
    kvalid = j < seq[:, None]
    jc = np.where(kvalid, j, 0)
    blk = np.where(kvalid, meta.block_table[r[:, None], jc // bs], 0)
    mask = _mask(spec, j, pos, kvalid, tvalid) if keep_mask else None
    return ChunkWork(len(idx), w, s, tok, np.nonzero(tvalid), tok[tvalid], blk, jc % bs,
                     pos, j, kvalid, tvalid, mask)


def attend(query, kview, vview, spec, work, scale: float, softcap,
           sink, out, lse, kv_scales=(1.0, 1.0)) -> None:
    """Fill ``out`` [T, Hq, Dv] and ``lse`` [T, Hq] (float64) at the real tokens.

    ``kview``/``vview``: numpy [B, N, H, D] / [B, N, H, Dv] cache views; ``sink``: float64
    [H, g] (``-inf`` without sinks); ``work`` (chunks) from :func:`step_work`;
    ``kv_scales``: the (key, value) scales the cache's codes are read with (exact float64
    products): static numbers (an MLA latent uses the key's), or ``[B, N, H, 1]`` views of
    one scale per token and head.
    """
    ks, vs = kv_scales
    per_row = not np.isscalar(ks)
    h, d, dv = spec.num_kv_heads, spec.head_dim, spec.head_dim_v
    hq = query.shape[1]
    g = hq // h
    kv_same = spec.is_mla  # values are a prefix of the latent: gather once
    sk = sink[None, :, None, :]  # [1, H, 1, g]
    for c in work:
        v, w, s = c.v, c.w, c.s
        keys = kview[c.blk, c.off].astype(np.float64)  # [v, s, H, D]
        vals = keys[..., :dv] if kv_same else vview[c.blk, c.off].astype(np.float64)
        if per_row:  # one scale per token and head: [v, s, H, 1]
            keys *= ks[c.blk, c.off]
            vals *= vs[c.blk, c.off]
        else:
            if ks != 1.0:
                keys *= ks
            if vs != 1.0 and not kv_same:
                vals *= vs
        # Logits [v, H, w*g, s]: query heads h*g .. h*g+g-1 read KV head h (GQA).
        q = query[c.tok].astype(np.float64).reshape(v, w, h, g, d).transpose(0, 2, 1, 3, 4)
        logits = np.matmul(q.reshape(v, h, w * g, d), keys.transpose(0, 2, 3, 1))
        logits *= scale
        if softcap is not None:
            logits = softcap * np.tanh(logits / softcap)
        logits = logits.reshape(v, h, w, g, s)
        # Masked by select, never by adding -inf: invisible rows may hold NaN or inf.
        logits = np.where(c.visible(spec)[:, None, :, None, :], logits, -np.inf)
        m = np.maximum(logits.max(axis=-1, initial=-np.inf), sk)  # [v, H, w, g]
        m = np.where(np.isfinite(m), m, 0.0)  # nothing visible: keep exp() finite
        e = np.exp(logits - m[..., None]).reshape(v, h, w * g, s)
        den = e.sum(axis=-1).reshape(v, h, w, g) + np.exp(sk - m)
        num = _weighted_values(e, vals)  # [v, H, w*g, Dv]
        # No visible key and no sink: den = 0, num = 0, so out 0 and lse -inf.  A visible
        # NaN makes den NaN, and the NaN reaches out and lse.
        empty = den == 0
        den = np.where(empty, 1.0, den)
        o = num.reshape(v, h, w, g, dv) / den[..., None]
        ls = np.where(empty, -np.inf, m + np.log(den))
        # [v, H, w, g, ...] -> token rows [v, w, Hq, ...]; keep the real columns only.
        o = o.transpose(0, 2, 1, 3, 4).reshape(v, w, hq, dv)
        ls = ls.transpose(0, 2, 1, 3).reshape(v, w, hq)
        out[c.out_rows] = o[c.rows]
        lse[c.out_rows] = ls[c.rows]


def _weighted_values(e, vals):
    """sum_j e[.., j] * vals[j] over [v, H, rows, s] x [v, s, H, Dv].

    Rows a query does not see have weight 0 but may hold anything, NaN included (unwritten
    or recycled blocks); 0 * NaN must not leak, so non-finite values enter as 0 and only
    rows with nonzero weight on a non-finite value become NaN.
    """
    vt = vals.transpose(0, 2, 1, 3)  # [v, H, s, Dv]
    num = np.matmul(e, vt)
    # Any non-finite value, seen or not, makes its sums non-finite (0 * NaN is NaN): a
    # finite result proves no value needs the slow path.
    if np.isfinite(num).all():
        return num
    bad = ~np.isfinite(vt)
    num = np.matmul(e, np.where(bad, 0.0, vt))
    hit = np.matmul((e > 0).astype(np.float64), bad.astype(np.float64)) > 0
    return np.where(hit, np.nan, num)
