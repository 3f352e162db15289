"""Pallas TPU kernel: ragged paged attention over a mixed batch (decodes and prefills).

One grid step per query tile (up to ``tile_size`` tokens of one request; see
:mod:`kvabi_tpu.plan`).  Per-tile metadata and the block table are scalar prefetched; the
query tile arrives in VMEM through its BlockSpec; the cache planes stay in HBM
(``pl.ANY``).  The kernel walks the tile's visible pages ``pages_per_block`` at a time,
double buffered: while block ``b`` is computed, the DMAs of block ``b + 1`` are in flight.
Softmax is online (running max ``m``, sum ``l``, accumulator in float32), so a tile's cost
is proportional to the pages it sees; sinks seed ``m`` and ``l``; ``lse = m + log(l)``.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
from jax import numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .plan import TILE_KVLEN, TILE_NPAGES, TILE_PAGE_LO, TILE_POS0, TILE_QLEN, TILE_REQ

#: logit of a masked key: finite so that exp(mask - m) never sees inf - inf
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def _kernel(info_ref, table_ref, q_ref, sinks_ref, *refs, fmt, scale, softcap, kind,
            window, chunk, per_block, has_sinks):
    n = fmt.num_layer_planes
    caches = refs[:n]
    out_ref, lse_ref = refs[n], refs[n + 1]
    bufs = refs[n + 2:2 * n + 2]
    sem = refs[2 * n + 2]

    w = pl.program_id(0)
    req = info_ref[TILE_REQ, w]
    pos0 = info_ref[TILE_POS0, w]
    qlen = info_ref[TILE_QLEN, w]
    kvlen = info_ref[TILE_KVLEN, w]
    page_lo = info_ref[TILE_PAGE_LO, w]
    npages = info_ref[TILE_NPAGES, w]
    # lax.div/rem: truncating (all operands are >= 0), no sign fix-up in the kernel
    nblk = lax.div(npages + per_block - 1, per_block)
    bs = fmt.block_size
    bq, hq, d = q_ref.shape
    h = fmt.num_kv_heads
    g = hq // h
    rows = bq * g
    ncol = table_ref.shape[1]

    def copies(blk, slot):
        out = []
        for i in range(per_block):
            col = page_lo + blk * per_block + i
            ok = col < page_lo + npages
            page = jnp.where(ok, table_ref[req, jnp.minimum(col, ncol - 1)], 0)
            for cache, buf in zip(caches, bufs):
                out.append(pltpu.make_async_copy(cache.at[page], buf.at[slot, i],
                                                 sem.at[slot]))
        return out

    @pl.when(qlen > 0)
    def _attend():
        @pl.when(nblk > 0)
        def _first():
            for c in copies(0, 0):
                c.start()

        q = q_ref[...]
        qpos = pos0 + lax.div(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), g)
        init = []
        for hh in range(h):
            if has_sinks:
                s0 = jnp.broadcast_to(sinks_ref[:, hh * g:(hh + 1) * g], (bq, g))
                s0 = s0.reshape(rows, 1).astype(jnp.float32)
                # a sink of -inf is no sink (a bucketed plan always passes sinks): the
                # state then starts as in the branch below
                m0 = jnp.maximum(s0, MASK_VALUE)
                l0 = jnp.where(s0 > MASK_VALUE, 1.0, 0.0).astype(jnp.float32)
            else:
                m0 = jnp.full((rows, 1), MASK_VALUE, jnp.float32)
                l0 = jnp.zeros((rows, 1), jnp.float32)
            init.append((m0, l0, jnp.zeros((rows, d), jnp.float32)))

        def body(blk, carry):
            slot = lax.rem(blk, 2)

            @pl.when(blk + 1 < nblk)
            def _prefetch():
                for c in copies(blk + 1, 1 - slot):
                    c.start()

            for c in copies(blk, slot):
                c.wait()
            pages = tuple(buf[slot] for buf in bufs)
            first = (page_lo + blk * per_block) * bs
            kpos = first + lax.broadcasted_iota(jnp.int32, (1, per_block * bs), 1)
            # keys past the request or past the tile's pages are stale copies of some page
            real = kpos < jnp.minimum(kvlen, (page_lo + npages) * bs)
            mask = real & (kpos <= qpos)
            if kind == "sliding_window":
                mask &= kpos > qpos - window
            elif kind == "chunked_local":
                mask &= lax.div(kpos, chunk) == lax.div(qpos, chunk)
            keep = real.reshape(per_block * bs, 1)
            new = []
            for hh, (m, l, acc) in enumerate(carry):
                k, v = fmt.head_kv(pages, hh)
                k = jnp.where(keep, k, 0).astype(q.dtype)
                qh = q[:, hh * g:(hh + 1) * g, :].reshape(rows, d)
                s = lax.dot_general(qh, k, (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32) * scale
                if softcap is not None:
                    s = softcap * jnp.tanh(s / softcap)
                # Keys a row may not see are removed by select, never by arithmetic: their
                # bytes can be anything (NaN, inf: stale or recycled blocks).
                s = jnp.where(mask, s, MASK_VALUE)
                m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
                alpha = jnp.exp(m - m_new)
                p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
                l = alpha * l + p.sum(axis=1, keepdims=True)
                # Non-finite values enter the product as 0 (0 * NaN is NaN); a row that
                # gives one weight > 0 still becomes NaN, as the reference does.
                v32 = v.astype(jnp.float32)
                bad = jnp.logical_not(jnp.abs(v32) < jnp.inf)
                clean = jnp.where(bad, 0.0, v32).astype(v.dtype)
                pv = lax.dot_general(p.astype(v.dtype), clean, (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)
                hit = lax.dot_general((p > 0).astype(jnp.float32), bad.astype(jnp.float32),
                                      (((1,), (0,)), ((), ())),
                                      preferred_element_type=jnp.float32) > 0
                new.append((m_new, l, alpha * acc + jnp.where(hit, jnp.nan, pv)))
            return tuple(new)

        final = lax.fori_loop(0, nblk, body, tuple(init))
        for hh, (m, l, acc) in enumerate(final):
            out = acc / l
            out_ref[:, hh * g:(hh + 1) * g, :] = out.reshape(bq, g, d).astype(out_ref.dtype)
            lse_ref[:, hh * g:(hh + 1) * g] = (m + jnp.log(l)).reshape(bq, g)

    @pl.when(qlen == 0)
    def _empty():
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)
        lse_ref[...] = jnp.zeros(lse_ref.shape, lse_ref.dtype)


def paged_attention(query, planes, tile_info, page_table, q_index, out_index, sinks, *, fmt,
                    scale, softcap, kind, window, chunk, per_block, has_sinks, interpret):
    """Attention of ``query`` [T, Hq, D] over per-layer cache ``planes``; returns
    (out [T, Hq, D] in the query dtype, lse [T, Hq] float32)."""
    t, hq, d = query.shape
    w = tile_info.shape[1]
    bq = q_index.shape[0] // w
    tiles = query[q_index].reshape(w, bq, hq, d)
    sinks = sinks.reshape(1, hq).astype(jnp.float32)
    page_shape = (fmt.block_size,) + fmt.slot_shape
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(w,),
        in_specs=[pl.BlockSpec((None, bq, hq, d), lambda i, *_: (i, 0, 0, 0)),
                  pl.BlockSpec((1, hq), lambda i, *_: (0, 0))] + [any_spec] * len(planes),
        out_specs=[pl.BlockSpec((None, bq, hq, d), lambda i, *_: (i, 0, 0, 0)),
                   pl.BlockSpec((None, bq, hq), lambda i, *_: (i, 0, 0))],
        scratch_shapes=[pltpu.VMEM((2, per_block) + page_shape, p.dtype) for p in planes]
        + [pltpu.SemaphoreType.DMA((2,))],
    )
    kernel = functools.partial(_kernel, fmt=fmt, scale=scale, softcap=softcap, kind=kind,
                               window=window, chunk=chunk, per_block=per_block,
                               has_sinks=has_sinks)
    out, lse = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((w, bq, hq, d), query.dtype),
                   jax.ShapeDtypeStruct((w, bq, hq), jnp.float32)],
        interpret=interpret,
        name="kvabi_ragged_paged_attention",
    )(tile_info, page_table, tiles, sinks, *planes)
    return out.reshape(w * bq, hq, d)[out_index], lse.reshape(w * bq, hq)[out_index]

