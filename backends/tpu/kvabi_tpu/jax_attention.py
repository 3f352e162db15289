"""The ``tpu.jax`` computation: paged attention and cache writes in plain jax.numpy.

A second implementation, independent of the Pallas kernels: the cache write is one XLA
scatter by slot, and attention is *dense per tile* (no online softmax): each query tile
gathers all of its visible pages at once and takes an ordinary masked softmax in float32.
Tiles run through ``lax.map`` in batches sized to bound memory.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
from jax import numpy as jnp

from .plan import TILE_KVLEN, TILE_NPAGES, TILE_PAGE_LO, TILE_POS0, TILE_REQ

#: float32 elements one lax.map batch may hold (gathered keys, values and logits)
BATCH_ELEMENTS = 1 << 24


@functools.partial(jax.jit, static_argnames=("fmt",))
def scatter_slots(rows, slot_planes, slots, *, fmt):
    """``slot_planes[p][slots[t], ..., :D] = rows[p][t]`` for every token with a slot
    (>= 0); head-dim padding keeps its bytes."""
    oob = fmt.num_blocks * fmt.block_size
    idx = jnp.where(slots >= 0, slots, oob)
    return [plane.at[idx, ..., :r.shape[-1]].set(r, mode="drop")
            for plane, r in zip(slot_planes, rows)]


@functools.partial(jax.jit, static_argnames=(
    "fmt", "scale", "softcap", "kind", "window", "chunk", "has_sinks", "max_pages"))
def dense_attention(query, planes, tile_info, page_table, q_index, out_index, sinks, *, fmt,
                    scale, softcap, kind, window, chunk, has_sinks, max_pages):
    """(out [T, Hq, D] in the query dtype, lse [T, Hq] float32) over per-layer planes."""
    t, hq, d = query.shape
    w = tile_info.shape[1]
    bq = q_index.shape[0] // w
    h = fmt.num_kv_heads
    g = hq // h
    bs = fmt.block_size
    n = max_pages * bs
    ncol = page_table.shape[1]
    tiles = query[q_index].reshape(w, bq, hq, d)
    sink = sinks.astype(jnp.float32).reshape(h, g)
    prec = lax.Precision.HIGHEST

    def one(args):
        qt, info = args
        req, pos0, kvlen = info[TILE_REQ], info[TILE_POS0], info[TILE_KVLEN]
        lo, npages = info[TILE_PAGE_LO], info[TILE_NPAGES]
        cols = lo + jnp.arange(max_pages)
        ids = jnp.where(cols < lo + npages, page_table[req, jnp.clip(cols, 0, ncol - 1)], 0)
        k, v = fmt.all_kv(tuple(p[ids] for p in planes))  # [n, H, d]
        kpos = lo * bs + jnp.arange(n)
        real = kpos < jnp.minimum(kvlen, (lo + npages) * bs)
        k = jnp.where(real[:, None, None], k.astype(jnp.float32), 0.0)
        v = jnp.where(real[:, None, None], v.astype(jnp.float32), 0.0)
        qf = qt.astype(jnp.float32).reshape(bq, h, g, d)
        s = jnp.einsum("qhgd,nhd->hgqn", qf, k, precision=prec) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        qpos = pos0 + jnp.arange(bq)
        mask = real[None, :] & (kpos[None, :] <= qpos[:, None])
        if kind == "sliding_window":
            mask &= kpos[None, :] > qpos[:, None] - window
        elif kind == "chunked_local":
            mask &= (kpos[None, :] // chunk) == (qpos[:, None] // chunk)
        s = jnp.where(mask, s, -jnp.inf)
        m = s.max(axis=-1)  # [H, g, q]
        if has_sinks:
            m = jnp.maximum(m, sink[:, :, None])
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        e = jnp.exp(s - m[..., None])
        den = e.sum(axis=-1)
        if has_sinks:
            den = den + jnp.exp(sink[:, :, None] - m)
        num = jnp.einsum("hgqn,nhd->qhgd", e, v, precision=prec)
        den_q = den.transpose(2, 0, 1)[..., None]
        out = jnp.where(den_q > 0, num / jnp.where(den_q > 0, den_q, 1.0), 0.0)
        lse = jnp.where(den > 0, m + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)
        return out.reshape(bq, hq, d).astype(query.dtype), lse.transpose(2, 0, 1).reshape(bq, hq)

    per_tile = n * h * d * 2 + hq * bq * n * 2
    batch = max(1, min(w, BATCH_ELEMENTS // max(1, per_tile)))
    out, lse = lax.map(one, (tiles, tile_info.T), batch_size=batch)
    return out.reshape(w * bq, hq, d)[out_index], lse.reshape(w * bq, hq)[out_index]
