"""Pallas TPU kernel: write the step's new K/V into the paged cache, in place.

Input is the slice list of :func:`kvabi.transforms.kv_update_slices`: rows (cache slot,
first new token, length), none crossing a page.  Each grid step takes
``num_slices_per_block`` slices: it DMAs their token rows HBM -> VMEM scratch, waits, then
DMAs the scratch out to the cache slots, HBM -> HBM through VMEM.  The slices are scalar
prefetched (SMEM), the cache stays in HBM (``pl.ANY``) and is aliased to the output, so on a
TPU the update is in place; zero-length padding slices copy nothing.  Planes are passed as
slot-major arrays ``[num_blocks * block_size, ...]`` (a free reshape outside the kernel).
"""
from __future__ import annotations

import functools

import jax
from jax import numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def _kernel(slices_ref, count_ref, *refs, num_planes: int):
    new_refs = refs[:num_planes]
    # refs[num_planes:2*num_planes] are the aliased cache inputs; write through the outputs
    out_refs = refs[2 * num_planes:3 * num_planes]
    scratch = refs[3 * num_planes:4 * num_planes]
    sem = refs[4 * num_planes]
    per = scratch[0].shape[0]
    step = pl.program_id(0)

    def row(i):
        j = step * per + i
        ok = j < count_ref[0]
        return (jnp.where(ok, slices_ref[0, j], 0), jnp.where(ok, slices_ref[1, j], 0),
                jnp.where(ok, slices_ref[2, j], 0))

    rows = [row(i) for i in range(per)]
    copies = []
    for i, (_, src, length) in enumerate(rows):
        for new, buf in zip(new_refs, scratch):
            c = pltpu.make_async_copy(new.at[pl.ds(src, length)], buf.at[i, pl.ds(0, length)],
                                      sem)
            c.start()
            copies.append(c)
    for c in copies:
        c.wait()
    copies = []
    for i, (dst, _, length) in enumerate(rows):
        for out, buf in zip(out_refs, scratch):
            c = pltpu.make_async_copy(buf.at[i, pl.ds(0, length)], out.at[pl.ds(dst, length)],
                                      sem)
            c.start()
            copies.append(c)
    for c in copies:
        c.wait()


@functools.partial(jax.jit, static_argnames=("block_size", "per", "interpret"))
def update_slots(new_rows, slot_planes, slices, count, *, block_size: int, per: int,
                 interpret):
    """Copy ``new_rows[p][tok:tok+len]`` to ``slot_planes[p][slot:slot+len]`` for every
    slice; returns the updated slot planes.  ``slices`` int32 [3, S] (S a multiple of
    ``per``), ``count`` int32 [1]."""
    n = len(slot_planes)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(slices.shape[1] // per,),
        in_specs=[any_spec] * (2 * n),
        out_specs=[any_spec] * n,
        scratch_shapes=[pltpu.VMEM((per, block_size) + r.shape[1:], r.dtype)
                        for r in new_rows] + [pltpu.SemaphoreType.DMA],
    )
    # Operand indices count the two scalar-prefetch arrays: cache p is operand 2 + n + p.
    call = pl.pallas_call(
        functools.partial(_kernel, num_planes=n),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(p.shape, p.dtype) for p in slot_planes],
        input_output_aliases={2 + n + p: p for p in range(n)},
        interpret=interpret,
        name="kvabi_kv_cache_update",
    )
    return call(slices, count, *new_rows, *slot_planes)
