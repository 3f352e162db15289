"""The reference backend's attention math: padded, batched, float64.

Each request's query tokens are cut into *pieces* of at most ``query_piece`` consecutive
tokens; a piece is padded to a power-of-two width and only looks at the key positions its
tokens can possibly see (``key0 .. key0 + nkeys - 1``: everything up to the last token for
full attention, the window or chunk otherwise).  Pieces of one width, sorted by key count, are
processed in bounded chunks: gather keys and values by block table into ``[v, S, H, D]``,
batched matmul for the logits ``[v, H, width*g, S]``, mask from positions, written-out
softmax with sinks, batched matmul for the output.  Python loops run over widths and chunks
only, never over tokens or requests.
"""
from __future__ import annotations

import attrs
import numpy as np


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


def attend(query, kview, vview, plan, sink, out, lse, *, budget: int) -> None:
    """Fill ``out`` [T, Hq, Dv] and ``lse`` [T, Hq] at the real tokens of ``plan``.

    ``kview``/``vview``: numpy [B, N, H, D] / [B, N, H, Dv] cache views; ``sink``: float64
    [H, g] (``-inf`` without sinks).
    """
    meta, spec, pieces = plan.meta, plan.spec, plan.pieces
    h, d, dv = spec.num_kv_heads, spec.head_dim, spec.head_dim_v
    hq = query.shape[1]
    g = hq // h
    bs = spec.block_size
    bt = meta.block_table
    kv_same = spec.is_mla  # values are a prefix of the latent: gather once
    per_key = h * (d + (0 if kv_same else dv))
    for idx, w, s in _chunks(pieces, per_key, 3 * hq, budget):
        v = len(idx)
        r = pieces.req[idx]
        seq = meta.seq_lens[r].astype(np.int64)
        # Query tokens [v, w]; padding columns of a piece repeat its first token.
        col = np.arange(w, dtype=np.int64)
        tvalid = col[None, :] < pieces.length[idx][:, None]
        tok = np.where(tvalid, pieces.start[idx][:, None] + col[None, :],
                       pieces.start[idx][:, None])
        pos = meta.positions[tok]
        # Key positions [v, s] and their cache rows; rows past seq_len read block 0 row 0..
        j = pieces.key0[idx][:, None] + np.arange(s, dtype=np.int64)[None, :]
        kvalid = j < seq[:, None]
        jc = np.where(kvalid, j, 0)
        blk = np.where(kvalid, bt[r[:, None], jc // bs], 0)
        keys = kview[blk, jc % bs].astype(np.float64)  # [v, s, H, D]
        vals = keys[..., :dv] if kv_same else vview[blk, jc % bs].astype(np.float64)
        # Logits [v, H, w*g, s]: query heads h*g .. h*g+g-1 read KV head h (GQA).
        q = query[tok].astype(np.float64).reshape(v, w, h, g, d).transpose(0, 2, 1, 3, 4)
        logits = np.matmul(q.reshape(v, h, w * g, d), keys.transpose(0, 2, 3, 1))
        logits *= plan.scale
        if plan.softcap is not None:
            logits = plan.softcap * np.tanh(logits / plan.softcap)
        mask = (j[:, None, :] <= pos[:, :, None]) & kvalid[:, None, :] & tvalid[:, :, None]
        if spec.kind == "sliding_window":
            mask &= j[:, None, :] > pos[:, :, None] - spec.window
        elif spec.kind == "chunked_local":
            mask &= j[:, None, :] // spec.chunk == pos[:, :, None] // spec.chunk
        logits = logits.reshape(v, h, w, g, s)
        logits = np.where(mask[:, None, :, None, :], logits, -np.inf)
        sk = sink[None, :, None, :]  # [1, H, 1, g]
        m = np.maximum(logits.max(axis=-1, initial=-np.inf), sk)  # [v, H, w, g]
        m = np.where(np.isfinite(m), m, 0.0)  # nothing visible: keep exp() finite
        e = np.exp(logits - m[..., None]).reshape(v, h, w * g, s)
        den = e.sum(axis=-1).reshape(v, h, w, g) + np.exp(sk - m)
        num = _weighted_values(e, vals)  # [v, H, w*g, Dv]
        with np.errstate(divide="ignore", invalid="ignore"):
            o = np.where(den[..., None] > 0, num.reshape(v, h, w, g, dv) / den[..., None], 0.0)
            ls = np.where(den > 0, m + np.log(den), -np.inf)
        # [v, H, w, g, ...] -> token rows [v, w, Hq, ...]; keep the real columns only.
        o = o.transpose(0, 2, 1, 3, 4).reshape(v, w, hq, dv)
        ls = ls.transpose(0, 2, 1, 3).reshape(v, w, hq)
        out[tok[tvalid]] = o[tvalid]
        lse[tok[tvalid]] = ls[tvalid]


def _weighted_values(e, vals):
    """sum_j e[.., j] * vals[j] over [v, H, rows, s] x [v, s, H, Dv].

    Rows a query does not see have weight 0 but may hold anything, NaN included (unwritten
    or recycled blocks); 0 * NaN must not leak, so non-finite values enter as 0 and only
    rows with nonzero weight on a non-finite value become NaN.
    """
    vt = vals.transpose(0, 2, 1, 3)  # [v, H, s, Dv]
    bad = ~np.isfinite(vt)
    if not bad.any():
        return np.matmul(e, vt)
    num = np.matmul(e, np.where(bad, 0.0, vt))
    hit = np.matmul((e > 0).astype(np.float64), bad.astype(np.float64)) > 0
    return np.where(hit, np.nan, num)
