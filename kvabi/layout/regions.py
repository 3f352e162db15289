"""The byte regions of a set of blocks, over all components of a layout (``specs/layout.md``,
*Block regions*).

Per component, the bytes of one block (of one layer, when only some layers are asked and
``L`` lies inside ``B``) lie in one *hull*: from its first to its last byte, holding only
elements of that block and bytes of no element (the overlap rule of ``layout_check``
keeps other blocks' bytes out of it).  The hulls of all components of the blocks asked
are enumerated with numpy broadcasting (no Python loop per block), joined where they
overlap or touch, then joined across a gap when the gap holds no byte of any element
(padding between blocks, page alignment): a region never holds a byte of a block or layer
that was not asked, and regions are the fewest.
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from ..util.coerce import int_array
from ..util.errors import KVABIError

#: The most pieces :func:`block_regions` enumerates for one call (before merging).
MAX_BLOCK_REGIONS = 2**24


def _hull_axes(c, sizes, cut_stride):
    """(in-plane axes outside the cut, outermost first, as (axis, stride, size)), and the
    span of one entry: everything at strides below ``cut_stride``, plus one unit."""
    outer, span = [], c.unit
    for a, s in c.strides.items():
        n = c.units if a == "E" else sizes.get(a, 1)
        if s >= cut_stride or a == "B":
            outer.append((a, s, n))
        else:
            span += (n - 1) * s
    outer.sort(key=lambda x: -x[1])
    return outer, span


def elements_meet(placed, xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Whether byte ranges ``[xs, ys)`` of a plane a component reaches hold a byte of any
    of its elements (any block, any layer).  Its axes are nested, so addresses follow
    the lexicographic order of indices: a greedy mixed-radix decode finds the last element
    starting before ``ys``, and the range meets an element when that one ends after
    ``xs``."""
    c = placed.component
    t = ys - 1 - c.offset
    ok = t >= 0
    t = np.where(ok, t, 0)
    start = np.full(t.shape, c.offset, np.int64)
    for s, n in placed.axes:
        i = np.minimum(t // s, n - 1)
        t = t - i * s
        start += i * s
    return ok & (start + c.unit > xs)


def _values(a, blocks, lay, sizes, units):
    if a == "E":
        return np.arange(units, dtype=np.int64)
    if a == "B":
        return blocks
    if a == "L" and lay is not None:
        return lay
    return np.arange(sizes.get(a, 1), dtype=np.int64)


def block_regions(layout, block_ids, layers=None):
    """See :meth:`kvabi.Layout.block_regions`."""
    blocks = np.unique(int_array(block_ids, "block_ids", ndim=None).ravel())
    if blocks.size and (blocks[0] < 0 or blocks[-1] >= layout.num_blocks):
        bad = blocks[0] if blocks[0] < 0 else blocks[-1]
        raise KVABIError(f"block_ids: {int(bad)} out of range [0, {layout.num_blocks})")
    nl = layout.num_layers
    if layers is None:
        lay = None
    else:
        if isinstance(layers, (Iterator, range, set, frozenset)):
            layers = sorted(layers) if isinstance(layers, (set, frozenset)) else list(layers)
        lay = np.unique(int_array(layers, "layers", ndim=None).ravel())
        if lay.size and (lay[0] < 0 or lay[-1] >= nl):
            bad = lay[0] if lay[0] < 0 else lay[-1]
            raise KVABIError(f"layers: {int(bad)} out of range [0, {nl})")
        if not lay.size:
            return []
        if lay.size == nl:
            lay = None
    if not blocks.size:
        return []
    sizes = {a: layout.size(a) for a in ("L", "B", "N", "H")}
    if layout.uniform_planes:  # global byte address = plane * size + offset
        size = np.int64(layout.plane_nbytes)
        base_of = lambda q: np.asarray(q, np.int64) * size  # noqa: E731
        plane_at = lambda g: g // size  # noqa: E731
    else:
        base = np.r_[0, np.cumsum(layout.plane_sizes)[:-1]].astype(np.int64)
        base_of = lambda q: base[q]  # noqa: E731
        plane_at = lambda g: np.searchsorted(base, g, side="right") - 1  # noqa: E731
    starts, ends, total = [], [], 0
    for c in layout.components:
        cut = c.strides["B"]
        if lay is not None and "L" in c.strides and c.strides["L"] < cut:
            cut = c.strides["L"]
        outer, span = _hull_axes(c, sizes, cut)
        # fold the innermost enumerated axes whose entries touch and are all asked
        while outer and outer[-1][1] == span and not (
                outer[-1][0] == "B" and blocks.size < layout.num_blocks) and not (
                outer[-1][0] == "L" and lay is not None):
            a, s, n = outer.pop()
            span += (n - 1) * s
        ps = c.plane_strides.get("L")
        count = {"B": blocks.size, "L": lay.size if lay is not None else nl}
        total += (count["L"] if ps else 1) * math.prod(count.get(a, n) for a, _, n in outer)
        if total > MAX_BLOCK_REGIONS:
            raise KVABIError(f"block_ids: {len(blocks)} blocks of this layout lie in more "
                             f"than MAX_BLOCK_REGIONS = {MAX_BLOCK_REGIONS} separate pieces "
                             f"(blocks asked times the planes and the axes outside B)")
        vals = [_values(a, blocks, lay, sizes, c.units) for a, _, _ in outer]
        pl = (c.plane + ps * (lay if lay is not None else np.arange(nl, dtype=np.int64))) \
            if ps else np.array([c.plane], np.int64)
        off = np.full((1,) * (len(vals) + 1), c.offset, np.int64)
        for i, ((_, s, _), v) in enumerate(zip(outer, vals)):
            shape = [1] * (len(vals) + 1)
            shape[i + 1] = v.size
            off = off + (v * s).reshape(shape)
        g = base_of(pl).reshape((-1,) + (1,) * len(vals)) + off  # global byte address
        g = g.ravel()
        starts.append(g)
        ends.append(g + span)
    s = np.concatenate(starts)
    e = np.concatenate(ends)
    o = np.argsort(s, kind="stable")
    s, e = s[o], e[o]
    plane = plane_at(s)
    # join what overlaps or touches within a plane
    reach = np.maximum.accumulate(e)
    new = np.ones(s.size, bool)
    new[1:] = (s[1:] > reach[:-1]) | (plane[1:] != plane[:-1])
    first = np.flatnonzero(new)
    last = np.r_[first[1:], s.size] - 1
    rs, re_, rp = s[first], reach[last], plane[first]
    # join across gaps that meet no hull of any component (padding)
    if rs.size > 1:
        same = rp[1:] == rp[:-1]
        x, y = re_[:-1] - base_of(rp[:-1]), rs[1:] - base_of(rp[1:])
        free = same.copy()
        for c in layout.components:
            reach_q = np.isin(rp[:-1], _planes_of(c, nl))
            if reach_q.any():
                free &= ~(reach_q & elements_meet(layout._chk.placed[c.name], x, y))
        keep = np.r_[True, ~free]
        idx = np.flatnonzero(keep)
        lst = np.r_[idx[1:], rs.size] - 1
        rs, re_, rp = rs[idx], re_[lst], rp[idx]
    off = rs - base_of(rp)
    return [(int(p), int(a), int(n)) for p, a, n in zip(rp, off, re_ - rs)]


def _planes_of(c, nl: int) -> np.ndarray:
    ps = c.plane_strides.get("L")
    if ps:
        return c.plane + ps * np.arange(nl, dtype=np.int64)
    return np.array([c.plane], np.int64)


def next_element_start(placed, x: int) -> int | None:
    """The first byte at or after ``x`` where an element of the component starts (None:
    none): a block's bytes extend over the padding up to there."""
    c, axes = placed.component, placed.axes
    if x <= c.offset:
        return c.offset
    t, idx = x - 1 - c.offset, []
    for s, n in axes:
        i = min(t // s, n - 1)
        idx.append(i)
        t -= i * s
    start = c.offset + sum(i * s for i, (s, _) in zip(idx, axes))
    if start >= x:
        return start
    for k in range(len(axes) - 1, -1, -1):  # the next index, mixed radix
        if idx[k] + 1 < axes[k][1]:
            idx[k] += 1
            for j in range(k + 1, len(axes)):
                idx[j] = 0
            return c.offset + sum(i * s for i, (s, _) in zip(idx, axes))
    return None


def block_cells(layout, layer_blocks) -> list[tuple[int, int, int]]:
    """[(plane, lo, hi)] covering each (layer, block) of ``layer_blocks``: its regions,
    each extended over the padding that follows it (up to the next element of any
    component, or the plane's end), merged per plane."""
    placed = layout._chk.placed
    spans = []
    for layer, block in set(layer_blocks):
        for p, off, n in block_regions(layout, [block], [layer]):
            end = layout.plane_size(p)
            for c in layout.components:
                first, step, count = placed[c.name].planes
                if (p - first) % step == 0 and 0 <= (p - first) // step < count:
                    nxt = next_element_start(placed[c.name], off + n)
                    if nxt is not None:
                        end = min(end, nxt)
            spans.append((p, off, max(end, off + n)))
    spans.sort()
    merged = []
    for p, lo, hi in spans:
        if merged and merged[-1][0] == p and lo <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], hi)
        else:
            merged.append([p, lo, hi])
    return [tuple(m) for m in merged]
