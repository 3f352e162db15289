"""An independent oracle for transfers between shardings: the model's KV as one array over
*global* heads, written into each rank's cache (and read back) at the bytes
``Layout.byte_offset`` gives, for the global heads the rank's shard names; never through a
plan.  Planes sit inside buffers with guard bytes before and after them."""
from __future__ import annotations

import numpy as np

from kvabi import KVCache
from kvabi.dtypes import numpy_dtype
from kvabi.shard import shard_of
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
