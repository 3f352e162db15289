"""Do two layouts place every element at the same bytes?

Two descriptors can differ and still place every element identically (an axis of size 1
anywhere in the order, a fold, packing, extents that only pad).  The question an engine
asks is about placement: the same plane and byte offset for every logical element.
"""
from __future__ import annotations

from ..layout.descriptor import Layout
from ..util.errors import KVABIError

_AXES = ("L", "B", "KV", "N", "H", "D")
_ARG = {"L": "layer", "B": "block", "KV": "kv", "N": "token", "H": "head", "D": "dim"}


def _label(layout: Layout) -> str:
    return layout.name or "the custom layout"


def placement_difference(a: Layout, b: Layout) -> str | None:
    """None when ``a`` and ``b`` place every element at the same (plane, byte offset),
    else one sentence naming the first difference.

    Every component is affine per plane, its plane stepping by a constant per layer, so
    equal sizes, the same components, the same place for each component's first element
    and for index 1 of every axis (of size > 1) mean the same place for every element.
    Plane byte counts are not compared (a larger buffer holds the same elements).
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
    if a.component_names != b.component_names:
        return (f"components: {_label(a)} holds {', '.join(a.component_names)}, {_label(b)} "
                f"{', '.join(b.component_names)}")
    if a.num_planes != b.num_planes:
        return (f"planes: {_label(a)} has {a.num_planes} planes ({a.planes or 'none'}), "
                f"{_label(b)} {b.num_planes} ({b.planes or 'none'})")
    for name in a.component_names:
        ca, cb = a.component(name), b.component(name)
        for f in ("dtype", "count"):
            if getattr(ca, f) != getattr(cb, f):
                return (f"{name}.{f}: {_label(a)} has {getattr(ca, f)}, {_label(b)} "
                        f"{getattr(cb, f)}")
    for what, name, idx in _steps(a):
        pa, pb = a.element_offset(name, **idx), b.element_offset(name, **idx)
        if pa != pb:
            return (f"{what}: {_label(a)} puts it at plane {pa[0]}, byte {pa[1]}; "
                    f"{_label(b)} at plane {pb[0]}, byte {pb[1]}")
    return None


def _steps(lay: Layout):
    """(label, component, indices): each component's first element and index 1 of each
    of its axes of size > 1, keys first (labels as the K/V axes name them: ``kv 1``,
    ``token 1``; a scale ``key_scale token 1``)."""
    arg = {"L": "layer", "B": "block", "N": "token", "H": "head"}
    out = []
    for c in lay.components:
        prefix = {"key": "", "value": "kv 1, ", "latent": ""}.get(c.name, f"{c.name} ")
        first = {"key": "the first element", "value": "kv 1", "latent": "the first element"
                 }.get(c.name, f"{c.name}'s first element")
        out.append((first, c.name, {}))
        for ax in ("L", "B", "N", "H"):
            if lay.size(ax) > 1:
                out.append((f"{prefix}{arg[ax]} 1", c.name, {arg[ax]: 1}))
        step = c.count // c.units  # the next storage unit (packed: element 2)
        if c.units > 1:
            out.append((f"{prefix}{'dim' if c.name in ('key', 'value', 'latent') else 'index'}"
                        f" {step}", c.name, {"index": step}))
    # the value's first element right after the key's outer steps, as before components
    key = [s for s in out if s[1] == "key"]
    if key and lay.has_kv:
        rest = [s for s in out if s[1] != "key"]
        outer = [s for s in key if s[2].keys() <= {"layer", "block"}]
        inner = [s for s in key if s not in outer]
        out = outer + rest[:1] + inner + rest[1:]
    return out


def same_placement(a: Layout, b: Layout) -> bool:
    """Every element at the same (plane, byte offset) in ``a`` and ``b``."""
    return placement_difference(a, b) is None
