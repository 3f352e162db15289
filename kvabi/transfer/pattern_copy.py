"""Executing a whole-block plan (:class:`~kvabi.transfer.pattern.BlockPattern`) as strided
copies: the source and destination of a run of sub-blocks are views of the same logical
shape ``[sub-blocks, (layers), tokens, heads, elements]`` of one component over the two
planes' bytes, copied with one ``np.copyto`` / ``Tensor.copy_`` per run, component and
plane pair.

Every view is the union of the plan's regions for its sub-blocks (the template shifted by
their bases), which ``TransferPlan.check`` has bounded before any byte moves.
"""
from __future__ import annotations

import numpy as np

from ..layout.descriptor import Layout


def runs(base_s: np.ndarray, base_t: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Split sub-blocks (in plan order) into runs whose bases step by constant strides on
    both sides: ``(first, length, source step, destination step)``.  A Python step per run,
    not per sub-block."""
    m = base_s.size
    if m == 1:
        return [(0, 1, 0, 0)]
    ds, dt = np.diff(base_s), np.diff(base_t)
    change = np.r_[(ds[1:] != ds[:-1]) | (dt[1:] != dt[:-1]), True]
    seg_end = np.flatnonzero(change)  # last diff index of each stretch of equal steps
    end_of = np.repeat(seg_end, np.diff(np.r_[-1, seg_end]))  # per diff index
    out, i = [], 0
    while i < m:
        if i == m - 1:
            out.append((i, 1, 0, 0))
            break
        j = int(end_of[i]) + 1  # last element reached with the steps of diff i
        if j == i + 1 and j < m - 2 and ds[j] == ds[j + 1] and dt[j] == dt[j + 1]:
            # a lone step before a longer run: element j starts that run instead
            out.append((i, 1, 0, 0))
            i += 1
            continue
        out.append((i, j - i + 1, int(ds[i]), int(dt[i])))
        i = j + 1
    return out


def _boxes(src: Layout, dst: Layout, layers: np.ndarray, u: int, names=None):
    """Per component: its element size, the axes copied inside one view (size, source
    stride, destination stride), outermost first in the source's order, and the (source
    plane, source offset, destination plane, destination offset) of each view of a
    sub-block: L joins the view where both components hold it in-plane."""
    out = []
    contiguous_layers = layers.size > 1 and layers[-1] - layers[0] + 1 == layers.size
    for name in src.component_names if names is None else names:
        cs, cd = src.component(name), dst.component(name)
        in_view = contiguous_layers and "L" in cs.strides and "L" in cd.strides
        dims = [(layers.size, cs.strides["L"], cd.strides["L"])] if in_view else []
        for a, count in (("N", u), ("H", src.size("H")), ("E", cs.units)):
            if a in cs.strides and count > 1:
                dims.append((count, cs.strides[a], cd.strides[a]))
        # numpy walks (and merges) axes in the order given: contiguous boxes become a memcpy
        dims.sort(key=lambda d: -d[1])
        views = []
        for lay in (layers[:1] if in_view else layers).tolist():
            off = []
            for c in (cs, cd):
                off.append((c.plane + lay * c.plane_strides.get("L", 0),
                            c.offset + lay * c.strides.get("L", 0)))
            views.append((off[0][0], off[0][1], off[1][0], off[1][1]))
        out.append((cs.unit, dims, views))
    return out


def copy_pattern(pat, src: Layout, dst: Layout, sbytes, dbytes, *, torch_side: bool) -> None:
    """Copy every sub-block of ``pat`` from the flat byte planes ``sbytes`` to ``dbytes``
    (numpy arrays, or torch tensors when ``torch_side``)."""
    for part in getattr(pat, "parts", (pat,)):
        _copy_part(part, src, dst, sbytes, dbytes, torch_side)


def _copy_part(pat, src, dst, sbytes, dbytes, torch_side):
    todo = runs(pat.src_base, pat.dst_base)
    if torch_side:
        import torch

        if any(a < 0 or b < 0 for _, n, a, b in todo if n > 1):  # torch: no negative strides
            todo = [(i, 1, 0, 0) for i in range(pat.src_base.size)]
    for isz, dims, views in _boxes(src, dst, pat.layers, pat.u, pat.components):
        shape = tuple(d[0] for d in dims)
        s_str = tuple(d[1] for d in dims)
        d_str = tuple(d[2] for d in dims)
        if torch_side:
            dt = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[isz]
            se = [b.view(dt) if b is not None else None for b in sbytes]
            de = [b.view(dt) if b is not None else None for b in dbytes]

            def view(flat, off, n, step, strides):
                return flat.as_strided((n,) + shape,
                                       tuple(x // isz for x in (step,) + strides),
                                       flat.storage_offset() + off // isz)

            for sp, so, dp, do in views:
                for i, n, a, b in todo:
                    view(de[dp], do + int(pat.dst_base[i]), n, b, d_str).copy_(
                        view(se[sp], so + int(pat.src_base[i]), n, a, s_str))
            continue
        dt = np.dtype(f"u{isz}")
        # ndarray over the flat bytes (not as_strided: ~10x less Python per view); numpy
        # refuses a view reaching outside its buffer
        for sp, so, dp, do in views:
            sbuf, dbuf = sbytes[sp], dbytes[dp]
            for i, n, a, b in todo:
                sv = np.ndarray((n,) + shape, dt, sbuf, so + int(pat.src_base[i]),
                                (a,) + s_str)
                dv = np.ndarray((n,) + shape, dt, dbuf, do + int(pat.dst_base[i]),
                                (b,) + d_str)
                np.copyto(dv, sv)
