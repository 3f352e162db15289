"""An independent oracle for transfers between shardings: the model's KV as one array over
*global* heads, written into each rank's cache (and read back) at the bytes
``Layout.byte_offset`` gives, for the global heads the rank's shard names; never through a
plan.  Planes sit inside buffers with guard bytes before and after them."""
from __future__ import annotations

import numpy as np

from kvabi import Component, KVCache, Layout
from kvabi.util.dtypes import numpy_dtype
from kvabi.model.shard import Shard, shard_of
from transfer_oracle import POISON, element_bytes

GUARD = 64


def model_kv(rng, layers, tokens, has_kv, heads, dim, isz):
    """The model's KV: random bytes [layer, token, kv, global head, dim * itemsize]."""
    return rng.integers(0, 256, (layers, tokens, 2 if has_kv else 1, heads, dim * isz),
                        dtype=np.uint8)


def guarded_cache(layout, rng=None, fill=POISON):
    """(buffers with GUARD bytes either side, a KVCache of numpy planes inside them):
    random bytes with ``rng``, else ``fill``."""
    isz = layout.itemsize
    n = -(-layout.plane_nbytes // isz) * isz + 2 * GUARD
    bufs, planes = [], []
    for _ in range(layout.num_planes):
        buf = (rng.integers(0, 256, n, dtype=np.uint8) if rng is not None
               else np.full(n, fill, np.uint8))
        raw = buf[GUARD:n - GUARD].view(np.dtype(f"u{isz}"))
        p = np.lib.stride_tricks.as_strided(raw, layout.plane_shape,
                                            [s * isz for s in layout.plane_strides])
        planes.append(p.view(numpy_dtype(layout.dtype)))
        bufs.append(buf)
    return bufs, KVCache.wrap(layout, planes)


def _places(layout, layers, slots):
    plane, off = element_bytes(layout, layers, slots)
    return np.asarray(plane), np.asarray(off) + GUARD


def write_rank(bufs, layout, content, layers, slots):
    """Write ``content`` (the model's KV over all layers and tokens) for the global heads of
    ``layout``'s shard at ``slots`` (token i at slots[i]) of ``layers``."""
    heads = np.asarray(shard_of(layout).heads)
    mine = content[np.asarray(layers)][:, :len(slots)][:, :, :, heads]
    plane, off = _places(layout, layers, slots)
    isz = layout.itemsize
    data = mine.reshape(plane.shape + (isz,))
    for p in np.unique(plane):
        m = plane == p
        bufs[int(p)][off[m][:, None] + np.arange(isz)] = data[m]


def check_rank(bufs, before, layout, content, layers, slots):
    """Every element of ``layout``'s heads at ``slots`` x ``layers`` holds the model's KV
    of its global head; every other byte, guards included, is as in ``before``."""
    heads = np.asarray(shard_of(layout).heads)
    want = content[np.asarray(layers)][:, :len(slots)][:, :, :, heads]
    plane, off = _places(layout, layers, slots)
    isz = layout.itemsize
    want = want.reshape(plane.shape + (isz,))
    touched = [np.zeros(b.size, bool) for b in bufs]
    for p in np.unique(plane):
        m = plane == p
        idx = off[m][:, None] + np.arange(isz)
        got = bufs[int(p)][idx]
        bad = np.flatnonzero(~np.all(got == want[m], axis=-1))
        assert not bad.size, (f"plane {int(p)}: {bad.size} elements differ from the model's "
                              f"KV of their global head")
        touched[int(p)][idx.ravel()] = True
    for i, (b, old, t) in enumerate(zip(bufs, before, touched)):
        changed = np.flatnonzero((b != old) & ~t)
        assert not changed.size, (f"plane {i}: byte {int(changed[0]) - GUARD} changed outside "
                                  f"the moved elements (guards are bytes -{GUARD}..-1 and "
                                  f"past the plane)")


# -- component layouts: every component (values and scales) by element_offset ---------------
def component_cache(layout, rng=None, fill=POISON):
    """:func:`guarded_cache` for any layout: a component layout's planes (each of its own
    size) are flat arrays of its dtype over buffers with GUARD bytes either side."""
    if layout.is_axis_form:
        return guarded_cache(layout, rng, fill)
    isz = layout.itemsize
    bufs, planes = [], []
    for size in layout.plane_sizes:
        n = -(-size // isz) * isz
        buf = (rng.integers(0, 256, n + 2 * GUARD, dtype=np.uint8) if rng is not None
               else np.full(n + 2 * GUARD, fill, np.uint8))
        planes.append(buf[GUARD:GUARD + n].view(numpy_dtype(layout.dtype)))
        bufs.append(buf)
    return bufs, KVCache.wrap(layout, planes)


def component_model(rng, layout, layers, tokens, heads):
    """The model's KV per component of ``layout`` (any rank's: the record of one token of
    one head is the same on every rank): name -> random bytes [layer, token, global head,
    unit, unit bytes] (a unit: one element, or two packed 4-bit ones)."""
    return {c.name: rng.integers(0, 256, (layers, tokens, heads, c.units, c.unit),
                                 dtype=np.uint8) for c in layout.components}


def _shared(layout, c) -> bool:
    """One record for all the layout's heads (no H stride, more than one head)."""
    return not c.varies("H") and layout.size("H") > 1


def record_keys(layout, name, sources):
    """The global head whose model record each local head of ``layout``'s component
    ``name`` holds: its own, except where the source group (``sources``, one layout per
    rank; None: ``layout`` is a source) shares one record across a rank's heads: then the
    record of the first head of the rank holding the head (replicas hold the same heads:
    the same record)."""
    heads = shard_of(layout).heads
    c = layout.component(name)
    group = [layout] if sources is None else sources
    out = []
    for g in (heads if c.varies("H") or layout.size("H") == 1 else heads[:1]):
        holder = next(s for s in group if g in shard_of(s).heads)
        sc = holder.component(name)
        out.append(shard_of(holder).heads[0] if _shared(holder, sc) else g)
    return np.asarray(out)


def _component_places(layout, c, layers, slots):
    """(plane, first byte + GUARD) of every unit of component ``c`` at layers x slots x
    local heads x units, shaped [layers, slots, heads, units] (heads: 1 where ``c`` does
    not vary along H)."""
    bs = layout.size("N")
    slots = np.asarray(slots)
    if not c.varies("N"):
        raise AssertionError(f"{c.name}: per-block components are not modelled here")
    nh = layout.size("H") if c.varies("H") else 1
    per = c.count // c.units
    lay, sl, h, u = np.ix_(np.asarray(layers), slots, np.arange(nh), np.arange(c.units))
    p, o = layout.element_offset(c.name, layer=lay, block=sl // bs, token=sl % bs, head=h,
                                 index=u * per)
    shape = np.broadcast_shapes(np.shape(p), np.shape(o))
    return np.broadcast_to(p, shape), np.broadcast_to(o, shape) + GUARD


def write_components(bufs, layout, model, layers, slots, sources=None):
    """Write the model's records for ``layout``'s heads (source rank: ``sources`` None) at
    ``slots`` (token i at slots[i]) of ``layers``."""
    lay = np.asarray(layers)
    for c in layout.components:
        keys = record_keys(layout, c.name, sources)
        data = model[c.name][lay][:, :len(slots)][:, :, keys]  # [L, T, h, units, unit]
        plane, off = _component_places(layout, c, layers, slots)
        for p in np.unique(plane):
            m = plane == p
            bufs[int(p)][off[m][:, None] + np.arange(c.unit)] = data[m]


def check_components(bufs, before, layout, model, layers, slots, sources):
    """Every unit of every component of ``layout``'s heads at ``slots`` x ``layers`` holds
    the model's record (:func:`record_keys` against the source group ``sources``); every
    other byte, guards included, is as in ``before``."""
    lay = np.asarray(layers)
    touched = [np.zeros(b.size, bool) for b in bufs]
    for c in layout.components:
        keys = record_keys(layout, c.name, sources)
        want = model[c.name][lay][:, :len(slots)][:, :, keys]
        plane, off = _component_places(layout, c, layers, slots)
        for p in np.unique(plane):
            m = plane == p
            idx = off[m][:, None] + np.arange(c.unit)
            bad = np.flatnonzero(~np.all(bufs[int(p)][idx] == want[m], axis=-1))
            assert not bad.size, (f"{c.name}, plane {int(p)}: {bad.size} units differ from "
                                  f"the model's record of their head")
            touched[int(p)][idx.ravel()] = True
    for i, (b, old, t) in enumerate(zip(bufs, before, touched)):
        changed = np.flatnonzero((b != old) & ~t)
        assert not changed.size, (f"plane {i}: byte {int(changed[0]) - GUARD} changed outside "
                                  f"the moved elements")


# -- a layout with components shared by a rank's heads ----------------------------------------
def shared_scale_layout(heads_local, shard, num_blocks=4, bs=4, layers=2, dim=8):
    """int8 keys and values per (token, head), each with one float32 scale per token for
    all the rank's heads (no H stride): [B, N, H, K | V] then [B, N, k_scale, v_scale]."""
    rec = 2 * dim
    data = {"B": bs * (heads_local * rec + 8), "N": heads_local * rec + 8, "H": rec}
    sc = {"B": data["B"], "N": data["N"]}
    comps = [Component(name="key", dtype="int8", count=dim, strides={**data, "E": 1},
                       plane_strides={"L": 1}),
             Component(name="value", dtype="int8", count=dim, offset=dim,
                       strides={**data, "E": 1}, plane_strides={"L": 1}),
             Component(name="key_scale", dtype="float32", count=1,
                       offset=heads_local * rec, strides=sc, plane_strides={"L": 1}),
             Component(name="value_scale", dtype="float32", count=1,
                       offset=heads_local * rec + 4, strides=sc, plane_strides={"L": 1})]
    return Layout(sizes={"L": layers, "B": num_blocks, "N": bs, "H": heads_local},
                  components=comps, shard=shard)


def shared_scale_group(tp, heads=4):
    """One :func:`shared_scale_layout` per rank of a TP ``tp`` engine of ``heads`` heads."""
    return [shared_scale_layout(len(Shard.tp(r, tp, heads).heads), Shard.tp(r, tp, heads))
            for r in range(tp)]


def table(rng, tokens, block_size, num_blocks):
    """Slots of ``tokens`` positions over scattered blocks of one engine."""
    need = -(-tokens // block_size)
    blocks = rng.permutation(num_blocks)[:need]
    pos = np.arange(tokens)
    return blocks[pos // block_size] * block_size + pos % block_size, blocks
