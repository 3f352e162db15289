"""Pallas TPU kernel: write the step's new K/V into the paged cache, in place.

Input is the slice list of :func:`kvabi.transforms.kv_update_slices` with each cache slot
as (block, offset in block) (:func:`kvabi_tpu.plan.write_slices`): rows (block, offset,
first new token, length), none crossing a page, so every index is an exact int32 whatever
the cache size.  Each grid step takes
``num_slices_per_block`` slices: it DMAs their token rows HBM -> VMEM scratch, waits, then
DMAs the scratch out to the cache slots.  The slices are scalar prefetched (SMEM), the
cache stays in HBM (``pl.ANY``) and is aliased to the output, so on a TPU the update is in
place; zero-length padding slices copy nothing.  Planes arrive page-major
``[num_blocks, block_size, ..., Dpad]``.

Where the head dim is padded (``tpu.combined`` with head_dim < 128) the padding bytes must
keep their contents, so that plane is updated read-modify-write: the target slots are
DMAed into VMEM too, the new values stored over their first head_dim lanes, and the whole
rows DMAed back.
"""
from __future__ import annotations

import functools

import jax
from jax import numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu



def _kernel(slices_ref, count_ref, *refs, num_planes: int, rmw: tuple[bool, ...]):
    n = num_planes
    new_refs = refs[:n]
    # refs[n:2n] are the aliased cache inputs; reads and writes go through the outputs
    out_refs = refs[2 * n:3 * n]
    new_bufs = refs[3 * n:4 * n]
    row_bufs = refs[4 * n:5 * n]  # whole padded rows (only used by read-modify-write planes)
    sem = refs[5 * n]
    per = new_bufs[0].shape[0]
    step = pl.program_id(0)

    def row(i):
        j = step * per + i
        ok = j < count_ref[0]
        return tuple(jnp.where(ok, slices_ref[r, j], 0) for r in range(4))

    def run(copies):
        for c in copies:
            c.start()
        for c in copies:
            c.wait()

    rows = [row(i) for i in range(per)]
    copies = []
    for i, (blk, off, src, length) in enumerate(rows):
        for p in range(n):
            copies.append(pltpu.make_async_copy(new_refs[p].at[pl.ds(src, length)],
                                                new_bufs[p].at[i, pl.ds(0, length)], sem))
            if rmw[p]:
                copies.append(pltpu.make_async_copy(out_refs[p].at[blk, pl.ds(off, length)],
                                                    row_bufs[p].at[i, pl.ds(0, length)], sem))
    run(copies)
    sources = []
    for p in range(n):
        if rmw[p]:
            d = new_bufs[p].shape[-1]
            row_bufs[p][..., :d] = new_bufs[p][...]
            sources.append(row_bufs[p])
        else:
            sources.append(new_bufs[p])
    run([pltpu.make_async_copy(sources[p].at[i, pl.ds(0, length)],
                               out_refs[p].at[blk, pl.ds(off, length)], sem)
         for i, (blk, off, _, length) in enumerate(rows) for p in range(n)])


def update_slots(new_rows, page_planes, slices, count, *, block_size: int, per: int,
                 interpret):
    """Copy ``new_rows[p][tok:tok+len]`` to rows ``off:off+len`` of block ``blk``
    (``[..., :D]``) of ``page_planes[p]`` [B, N, ...] for every slice (D = the rows' last
    dim; the rest of each slot keeps its bytes); returns the updated planes.  ``slices``
    int32 [4, S] rows (blk, off, tok, len) (S a multiple of ``per``), ``count`` int32 [1]."""
    n = len(page_planes)
    rmw = tuple(r.shape[-1] != p.shape[-1] for r, p in zip(new_rows, page_planes))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(slices.shape[1] // per,),
        in_specs=[any_spec] * (2 * n),
        out_specs=[any_spec] * n,
        scratch_shapes=[pltpu.VMEM((per, block_size) + r.shape[1:], r.dtype)
                        for r in new_rows]
        + [pltpu.VMEM((per, block_size) + (p.shape[2:] if m else (1,)), p.dtype)
           for p, m in zip(page_planes, rmw)]
        + [pltpu.SemaphoreType.DMA],
    )
    # Operand indices count the two scalar-prefetch arrays: cache p is operand 2 + n + p.
    call = pl.pallas_call(
        functools.partial(_kernel, num_planes=n, rmw=rmw),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in page_planes],
        input_output_aliases={2 + n + p: p for p in range(n)},
        interpret=interpret,
        name="kvabi_kv_cache_update",
    )
    return list(call(slices, count, *new_rows, *page_planes))
