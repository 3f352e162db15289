"""The ``tpu.jax`` computation: paged attention and cache writes in plain jax.numpy.

A second implementation, sharing no code with the Pallas kernels: the cache write is one
XLA scatter by (block, offset), and attention takes one query tile at a time
(``lax.map``), gathers its visible pages ``chunk_pages`` at a time with an XLA gather, takes
a masked softmax of each chunk in float32 and merges the chunks by their log-sum-exp; the
loop over chunks stops at each tile's own page count, so work follows the real context.
"""
from __future__ import annotations

import jax
from jax import lax
from jax import numpy as jnp

from .plan import TILE_KVLEN, TILE_NPAGES, TILE_PAGE_LO, TILE_POS0, TILE_REQ

def scatter_slots(rows, page_planes, slots):
    """``page_planes[p][slot // N, slot % N, ..., :D] = rows[p][t]`` for every token with a
    slot (>= 0); head-dim padding keeps its bytes.  Indexing block and offset (rather than
    a reshaped [B*N] view) lets XLA update a donated cache in place."""
    out = []
    for plane, r in zip(page_planes, rows):
        blocks, n = plane.shape[:2]
        blk = jnp.where(slots >= 0, slots // n, blocks)  # out of range: dropped
        out.append(plane.at[blk, slots % n, ..., :r.shape[-1]].set(r, mode="drop"))
    return out


def paged_attention(query, planes, tile_info, page_table, q_index, out_index, sinks, *, fmt,
                    scale, softcap, kind, window, chunk, has_sinks, chunk_pages):
    """(out [T, Hq, D] in the query dtype, lse [T, Hq] float32) over per-layer planes."""
    t, hq, d = query.shape
    w = tile_info.shape[1]
    bq = q_index.shape[0] // w
    h = fmt.num_kv_heads
    g = hq // h
    bs = fmt.block_size
    n = chunk_pages * bs
    ncol = page_table.shape[1]
    tiles = query[q_index].reshape(w, bq, hq, d)
    sink = sinks.astype(jnp.float32).reshape(h, g)
    prec = lax.Precision.HIGHEST

    def one(args):
        qt, info = args
        req, pos0, kvlen = info[TILE_REQ], info[TILE_POS0], info[TILE_KVLEN]
        lo, npages = info[TILE_PAGE_LO], info[TILE_NPAGES]
        qf = qt.astype(jnp.float32).reshape(bq, h, g, d)
        qpos = pos0 + jnp.arange(bq)
        end = jnp.minimum(kvlen, (lo + npages) * bs)  # keys at or past `end`: not this tile's

        def part(c):
            """Softmax pieces of key chunk c: (max [H, g, q], sum, weighted values)."""
            cols = lo + c * chunk_pages + jnp.arange(chunk_pages)
            ids = jnp.where(cols < lo + npages, page_table[req, jnp.clip(cols, 0, ncol - 1)],
                            0)
            k, v = fmt.all_kv(tuple(p[ids] for p in planes))  # [n, H, d]
            kpos = (lo + c * chunk_pages) * bs + jnp.arange(n)
            real = kpos < end
            # stale keys only give logits that the mask replaces; stale values would turn
            # 0 * NaN into NaN, so they are zeroed
            k = k.astype(jnp.float32)
            v = jnp.where(real[:, None, None], v.astype(jnp.float32), 0.0)
            s = jnp.einsum("qhgd,nhd->hgqn", qf, k, precision=prec) * scale
            if softcap is not None:
                s = softcap * jnp.tanh(s / softcap)
            mask = real[None, :] & (kpos[None, :] <= qpos[:, None])
            if kind == "sliding_window":
                mask &= kpos[None, :] > qpos[:, None] - window
            elif kind == "chunked_local":
                mask &= (kpos[None, :] // chunk) == (qpos[:, None] // chunk)
            s = jnp.where(mask, s, -jnp.inf)
            m = s.max(axis=-1)
            safe = jnp.where(jnp.isfinite(m), m, 0.0)
            e = jnp.exp(s - safe[..., None])
            return m, e.sum(axis=-1), jnp.einsum("hgqn,nhd->hgqd", e, v, precision=prec)

        def merge(c, state):
            m0, l0, o0 = state
            m1, l1, o1 = part(c)
            m = jnp.maximum(m0, m1)
            safe = jnp.where(jnp.isfinite(m), m, 0.0)
            a0, a1 = jnp.exp(m0 - safe), jnp.exp(m1 - safe)
            return m, a0 * l0 + a1 * l1, a0[..., None] * o0 + a1[..., None] * o1

        if has_sinks:  # a sink is one more logit with a zero value vector
            m0 = jnp.broadcast_to(sink[:, :, None], (h, g, bq))
            l0 = jnp.ones((h, g, bq), jnp.float32)
        else:
            m0 = jnp.full((h, g, bq), -jnp.inf, jnp.float32)
            l0 = jnp.zeros((h, g, bq), jnp.float32)
        state = (m0, l0, jnp.zeros((h, g, bq, d), jnp.float32))
        m, l, o = lax.fori_loop(0, (npages + chunk_pages - 1) // chunk_pages, merge, state)
        ok = l > 0
        out = jnp.where(ok[..., None], o / jnp.where(ok, l, 1.0)[..., None], 0.0)
        lse = jnp.where(ok, m + jnp.log(jnp.where(ok, l, 1.0)), -jnp.inf)
        return (out.transpose(2, 0, 1, 3).reshape(bq, hq, d).astype(query.dtype),
                lse.transpose(2, 0, 1).reshape(bq, hq))

    # One tile at a time: the loop over key chunks then stops at each tile's own pages.
    out, lse = lax.map(one, (tiles, tile_info.T))
    return out.reshape(w * bq, hq, d)[out_index], lse.reshape(w * bq, hq)[out_index]
