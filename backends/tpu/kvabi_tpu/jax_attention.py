"""The ``tpu.jax`` computation: paged attention and cache writes in plain jax.numpy.

A second implementation, sharing no code with the Pallas kernels: the cache write is one
XLA scatter by (block, offset).  Attention runs per bucket of query tiles (decodes as
one-row tiles, other requests in taller ones; :mod:`.jax_buckets`), one tile at a time
(``lax.map``): the tile's visible pages are gathered a chunk at a time with an XLA gather,
each chunk's softmax pieces are taken in float32 and merged by their log-sum-exp.  Pages
that every row of the tile sees go unmasked in big chunks (few, large dots); the edges
(causal diagonal, window, attention chunk, the last page) go masked in small chunks, so
little work is padding.  The loops stop at each tile's own page count.
"""
from __future__ import annotations

import jax
from jax import lax
from jax import numpy as jnp

from kvabi.util.tensors import to_jax

from .plan import (TILE_KVLEN, TILE_NPAGES, TILE_PAGE_LO, TILE_POS0, TILE_QLEN, TILE_REQ,
                   next_pow2)

def scatter_slots(rows, page_planes, blocks, offsets):
    """``page_planes[p][blocks[t], offsets[t], ..., :D] = rows[p][t]`` for every token
    (padding tokens carry block ``num_blocks``: dropped); head-dim padding keeps its bytes.
    Indexing block and offset (never a flat slot) stays exact in int32 for any cache size
    and lets XLA update a donated cache in place."""
    return [plane.at[blocks, offsets, ..., :r.shape[-1]].set(r, mode="drop")
            for plane, r in zip(page_planes, rows)]


def paged_attention(query, planes, page_table, out_index, tiles, sinks, *, fmt, scale,
                    softcap, kind, window, chunk, has_sinks, buckets, chunk_pages):
    """(out [T, Hq, D] in the query dtype, lse [T, Hq] float32) over per-layer planes.

    ``buckets`` is ``((rows, num_tiles), ...)`` and ``tiles`` holds each bucket's
    (tile_info, q_index) (see :mod:`.jax_buckets`); ``out_index`` picks every token's row
    from the buckets' outputs concatenated."""
    t, hq, d = query.shape
    if not buckets:  # padding tokens only
        return jnp.zeros((t, hq, d), query.dtype), jnp.full((t, hq), -jnp.inf, jnp.float32)
    outs, lses = [], []
    for (rows, _), info, q_index in zip(buckets, tiles[0::2], tiles[1::2]):
        o, l = _bucket(query, planes, info, page_table, q_index, sinks, rows=rows, fmt=fmt,
                       scale=scale, softcap=softcap, kind=kind, window=window, chunk=chunk,
                       has_sinks=has_sinks, chunk_pages=chunk_pages[rows > 1])
        outs.append(o)
        lses.append(l)
    out = jnp.concatenate(outs) if len(outs) > 1 else outs[0]
    lse = jnp.concatenate(lses) if len(lses) > 1 else lses[0]
    return out[out_index], lse[out_index]


def _bucket(query, planes, tile_info, page_table, q_index, sinks, *, rows, fmt, scale,
            softcap, kind, window, chunk, has_sinks, chunk_pages):
    """(out [W*rows, Hq, D], lse [W*rows, Hq]) of one bucket's tiles of ``rows`` queries."""
    t, hq, d = query.shape
    w = tile_info.shape[1]
    bq = rows
    h = fmt.num_kv_heads
    g = hq // h
    bs = fmt.block_size
    big, small = chunk_pages
    ncol = page_table.shape[1]
    # head-major tiles [W, H, g*rows, D], pre-scaled: the chunk loop then only multiplies
    tiles = (query[q_index].astype(jnp.float32) * scale).reshape(w, bq, h, g, d)
    tiles = tiles.transpose(0, 2, 3, 1, 4).reshape(w, h, g * bq, d)
    sink = sinks.astype(jnp.float32).reshape(h, g)
    prec = lax.Precision.HIGHEST

    def one(args):
        qf, info = args
        req, pos0, kvlen = info[TILE_REQ], info[TILE_POS0], info[TILE_KVLEN]
        qlen, lo, npages = info[TILE_QLEN], info[TILE_PAGE_LO], info[TILE_NPAGES]
        qpos = pos0 + jnp.arange(bq)
        end = jnp.minimum(kvlen, (lo + npages) * bs)  # keys at or past `end`: not this tile's

        def part(first, cp, masked):
            """Softmax pieces of the ``cp`` pages from column ``first``: (max [H, g*rows],
            sum, weighted values); unmasked chunks are visible to every row."""
            cols = first + jnp.arange(cp)
            ids = jnp.where(cols < lo + npages, page_table[req, jnp.clip(cols, 0, ncol - 1)],
                            0)
            k, v = fmt.all_kv(tuple(jnp.take(p, ids, axis=0) for p in planes))  # [n, H, d]
            # head-major [H, n, d] for the dots
            k = k.astype(jnp.float32).transpose(1, 0, 2)
            v = v.astype(jnp.float32).transpose(1, 0, 2)
            s = jnp.einsum("hmd,hnd->hmn", qf, k, precision=prec)
            if softcap is not None:
                s = softcap * jnp.tanh(s / softcap)
            if not masked:  # every key is visible to every real row
                m = s.max(axis=-1)
                e = jnp.exp(s - m[..., None])
                return m, e.sum(axis=-1), jnp.einsum("hmn,hnd->hmd", e, v, precision=prec)
            # Rows a query may not see can hold anything (NaN, inf: stale or recycled
            # blocks), so they are removed by select, never by arithmetic: their logits
            # become -inf, and their values enter the product as 0 (0 * NaN would be NaN).
            kpos = first * bs + jnp.arange(cp * bs)
            mask = (kpos[None, :] < end) & (kpos[None, :] <= qpos[:, None])  # [rows, n]
            if kind == "sliding_window":
                mask &= kpos[None, :] > qpos[:, None] - window
            elif kind == "chunked_local":
                mask &= (kpos[None, :] // chunk) == (qpos[:, None] // chunk)
            s = jnp.where(mask[None, None], s.reshape(h, g, bq, -1), -jnp.inf)
            s = s.reshape(h, g * bq, -1)
            m = s.max(axis=-1)
            safe = jnp.where(jnp.isfinite(m), m, 0.0)
            e = jnp.exp(s - safe[..., None])
            fin = jnp.isfinite(v)
            pv = jnp.einsum("hmn,hnd->hmd", e, jnp.where(fin, v, 0.0), precision=prec)
            # a non-finite value a row does see (weight > 0) still makes that row NaN
            bad = (~fin.all(axis=-1)).astype(jnp.float32)  # [H, n]
            hit = jnp.einsum("hmn,hn->hm", (e > 0).astype(jnp.float32), bad) > 0
            return m, e.sum(axis=-1), jnp.where(hit[..., None], jnp.nan, pv)

        def merge(state, piece):
            m0, l0, o0 = state
            m1, l1, o1 = piece
            m = jnp.maximum(m0, m1)
            safe = jnp.where(jnp.isfinite(m), m, 0.0)
            a0, a1 = jnp.exp(m0 - safe), jnp.exp(m1 - safe)
            return m, a0 * l0 + a1 * l1, a0[..., None] * o0 + a1[..., None] * o1

        if has_sinks:  # a sink is one more logit with a zero value vector; -inf: none
            m0 = jnp.repeat(sink, bq, axis=1)
            l0 = jnp.where(m0 > -jnp.inf, 1.0, 0.0).astype(jnp.float32)
        else:
            m0 = jnp.full((h, g * bq), -jnp.inf, jnp.float32)
            l0 = jnp.zeros((h, g * bq), jnp.float32)
        state = (m0, l0, jnp.zeros((h, g * bq, d), jnp.float32))
        # Keys [a, b) are visible to every real row of the tile: their pages go unmasked,
        # in big chunks then small ones; the pages before and after go masked, in small
        # chunks.  Chunks partition the pages (a masked chunk may run past the last page).
        b = jnp.minimum(pos0 + 1, end)
        if kind == "sliding_window":
            a = pos0 + qlen - window
        elif kind == "chunked_local":
            a = jnp.where((pos0 + qlen - 1) // chunk == pos0 // chunk,
                          (pos0 // chunk) * chunk, b)
        else:
            a = lo * bs
        hi = lo + npages
        fa = jnp.clip(-(-a // bs), lo, hi)
        fb = jnp.clip(b // bs, lo, hi)
        nhead = (fa - lo + small - 1) // small
        fa = lo + nhead * small
        free = jnp.maximum(0, fb - fa)
        nbig = free // big
        nfree = (free - nbig * big) // small
        fb = fa + nbig * big + nfree * small
        ntail = jnp.maximum(0, hi - fb + small - 1) // small
        state = lax.fori_loop(0, nbig, lambda c, st: merge(st, part(fa + c * big, big, False)),
                              state)
        state = lax.fori_loop(0, nfree, lambda c, st: merge(
            st, part(fa + nbig * big + c * small, small, False)), state)
        m, l, o = lax.fori_loop(0, nhead + ntail, lambda c, st: merge(
            st, part(jnp.where(c < nhead, lo + c * small, fb + (c - nhead) * small), small,
                     True)), state)
        ok = l > 0
        out = jnp.where(ok[..., None], o / jnp.where(ok, l, 1.0)[..., None], 0.0)
        lse = jnp.where(ok, m + jnp.log(jnp.where(ok, l, 1.0)), -jnp.inf)
        return (out.reshape(h, g, bq, d).transpose(2, 0, 1, 3).reshape(bq, hq, d)
                .astype(query.dtype), lse.reshape(h, g, bq).transpose(2, 0, 1).reshape(bq, hq))

    # One tile at a time: the loop over key chunks then stops at each tile's own pages.
    out, lse = lax.map(one, (tiles, tile_info.T))
    return out.reshape(w * bq, hq, d), lse.reshape(w * bq, hq)


def attend_impl(plan, backend):
    """(attention function, device arrays, static keywords) of ``plan`` for the backend's
    ``_attend_impl``: decodes in one-row tiles, other requests in ``prefill_rows`` tiles."""
    from .jax_buckets import buckets

    static, (out_index, *tiles) = buckets(plan, prefill_rows=backend.prefill_rows,
                                          to_device=to_jax)
    bs, bucket = plan.spec.block_size, plan.prepared.bucket
    pages = -(-int(plan.meta.max_seq_len) // bs) if bucket is None else bucket.pages
    most = next_pow2(pages)

    def pages(tokens):  # a power of two of whole pages, no more than the longest sequence
        return max(1, min(next_pow2(-(-tokens // bs)), most))

    small = pages(backend.tail_chunk_tokens)
    chunks = tuple((max(small, pages(t)), small)
                   for t in (backend.decode_chunk_tokens, backend.chunk_tokens))
    return paged_attention, (plan.prepared.page_table, out_index, tuple(tiles)), (
        ("buckets", static), ("chunk_pages", chunks))
