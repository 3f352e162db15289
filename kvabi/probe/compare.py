"""Do two layouts place every element at the same bytes?

Two descriptors can differ and still place every element identically (an axis of size 1
anywhere in the order, a fold, packing, extents that only pad).  The question an engine
asks is about placement: the same plane and byte offset for every logical element.
"""
from __future__ import annotations

from ..errors import KVABIError
from ..layout import Layout

_AXES = ("L", "B", "KV", "N", "H", "D")
_ARG = {"L": "layer", "B": "block", "KV": "kv", "N": "token", "H": "head", "D": "dim"}


def _label(layout: Layout) -> str:
    return layout.name or "the custom layout"


def placement_difference(a: Layout, b: Layout) -> str | None:
    """None when ``a`` and ``b`` place every element at the same (plane, byte offset),
    else one sentence naming the first difference.

    Both are affine per plane with planes numbered row-major, so equal sizes, the same
    first element and the same place for index 1 of every axis (of size > 1) mean the same
    place for every element.  Plane byte counts are not compared (a larger buffer holds the
    same elements).
    """
    for x, field in ((a, "a"), (b, "b")):
        if not isinstance(x, Layout):
            raise KVABIError(f"{field}: must be a kvabi.Layout, got {type(x).__name__}")
    if a.dtype != b.dtype:
        return f"dtype: {_label(a)} holds {a.dtype}, {_label(b)} {b.dtype}"
    for ax in _AXES:
        if ax == "KV":
            if a.has_kv != b.has_kv:
                return f"KV: {_label(a if a.has_kv else b)} has key and value, the other " \
                       f"one latent plane (MLA)"
            continue
        if a.size(ax) != b.size(ax):
            return f"{ax}: {_label(a)} has {a.size(ax)}, {_label(b)} {b.size(ax)}"
    if a.num_planes != b.num_planes:
        return (f"planes: {_label(a)} has {a.num_planes} planes ({a.planes or 'none'}), "
                f"{_label(b)} {b.num_planes} ({b.planes or 'none'})")
    steps = [{}] + [{_ARG[ax]: 1} for ax in _AXES
                    if (ax == "KV" and a.has_kv) or (ax != "KV" and a.size(ax) > 1)]
    for idx in steps:
        pa, pb = a.byte_offset(**idx), b.byte_offset(**idx)
        if pa != pb:
            what = "the first element" if not idx else f"{next(iter(idx))} 1"
            return (f"{what}: {_label(a)} puts it at plane {pa[0]}, byte {pa[1]}; "
                    f"{_label(b)} at plane {pb[0]}, byte {pb[1]}")
    return None


def same_placement(a: Layout, b: Layout) -> bool:
    """Every element at the same (plane, byte offset) in ``a`` and ``b``."""
    return placement_difference(a, b) is None
