"""An independent oracle for transfer tests: raw byte buffers per plane, and the bytes each
logical element occupies computed through ``Layout.byte_offset`` (never through a plan)."""
from __future__ import annotations

import numpy as np

from kvabi.util.dtypes import numpy_dtype

POISON = 0xA5


def raw_planes(layout, rng=None, fill=POISON):
    """(byte buffers, numpy planes over them): random bytes when ``rng`` is given (padding
    included), else ``fill`` everywhere."""
    n = -(-layout.plane_nbytes // layout.itemsize) * layout.itemsize
    isz = layout.itemsize
    bufs, planes = [], []
    for _ in range(layout.num_planes):
        buf = (rng.integers(0, 256, n, dtype=np.uint8) if rng is not None
               else np.full(n, fill, np.uint8))
        raw = buf.view(np.dtype(f"u{isz}"))
        strides = [s * isz for s in layout.plane_strides]
        p = np.lib.stride_tricks.as_strided(raw, layout.plane_shape, strides)
        planes.append(p.view(numpy_dtype(layout.dtype)))
        bufs.append(buf)
    return bufs, planes


def element_bytes(layout, layers, slots):
    """(plane, first byte) of every element of ``slots`` x ``layers`` x kv x head x dim,
    shaped [layers, slots, kv, heads, dims] (the oracle's addressing)."""
    kv = np.arange(2 if layout.has_kv else 1)
    bs = layout.size("N")
    slots = np.asarray(slots)
    ix = np.ix_(np.asarray(layers), slots, kv, np.arange(layout.size("H")),
                np.arange(layout.size("D")))
    lay, sl, k, h, d = ix
    return layout.byte_offset(layer=lay, block=sl // bs, kv=k if layout.has_kv else 0,
                              token=sl % bs, head=h, dim=d)


def gather(bufs, plane, off, isz):
    """The bytes of each element: array [..., isz]."""
    out = np.empty(plane.shape + (isz,), np.uint8)
    for p in np.unique(plane):
        m = plane == p
        out[m] = bufs[int(p)][off[m][:, None] + np.arange(isz)]
    return out


def written_mask(bufs, plane, off, isz):
    """Boolean masks (one per plane) of the bytes the elements occupy."""
    masks = [np.zeros(b.size, bool) for b in bufs]
    for p in np.unique(plane):
        m = plane == p
        masks[int(p)][(off[m][:, None] + np.arange(isz)).ravel()] = True
    return masks


def check_moved(src, dst, layers, s, t, sbufs, dbufs, before):
    """Every element of (layers, s) of ``src`` equals ``dst``'s at (layers, t), read back
    through ``Layout.byte_offset``; every other destination byte is unchanged."""
    isz = src.itemsize
    sp, so = element_bytes(src, layers, s)
    dp, do = element_bytes(dst, layers, t)
    got = gather(dbufs, np.asarray(dp), np.asarray(do), isz)
    want = gather(sbufs, np.asarray(sp), np.asarray(so), isz)
    assert np.array_equal(got, want), "an element differs from the source's"
    masks = written_mask(dbufs, np.asarray(dp), np.asarray(do), isz)
    for b, old, m in zip(dbufs, before, masks):
        assert np.array_equal(b[~m], old[~m]), "a byte outside the moved elements changed"
