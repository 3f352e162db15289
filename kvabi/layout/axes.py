"""The axis form of a layout (``specs/layout.md``, *Axis form*): one memory order that keys
and values share, with padding, folds and packing, and the tensor a backend sees per
plane.  It is shorthand for components: :func:`axis_components` gives the key and value
(MLA: latent) components it means, byte for byte.
"""
from __future__ import annotations

import math

import attrs

from ..util.coerce import checked_bytes
from ..util.dtypes import check_dtype, itemsize
from ..util.errors import require
from ..util.frozen import FrozenDict
from .component import Component

AXES = ("L", "B", "KV", "N", "H", "D")
PLANE_AXES = ("L", "KV")


@attrs.frozen
class AxisGeometry:
    """What an axis-form layout derives from its fields (exact, checked): the byte stride
    of each memory-order axis, the bytes one plane spans and holds, the number of planes,
    and the tensor a backend sees per plane (shape, element strides, the logical axes of
    each dimension)."""

    stride: FrozenDict
    natural: int
    plane_nbytes: int
    num_planes: int
    shape: tuple
    elem_strides: tuple
    view_axes: tuple


def axis_geometry(lay) -> AxisGeometry:
    """Check the axis-form fields of ``lay`` (a Layout under construction) and derive its
    :class:`AxisGeometry`; KVABIError naming the field otherwise."""
    require(lay.dtype is not None, "dtype", "missing (the axis form needs the element dtype)")
    check_dtype(lay.dtype)
    isz = itemsize(lay.dtype)
    seen = list(lay.order) + list(lay.planes)
    for a in seen:
        require(a in AXES, "order", f"unknown axis {a!r}; axes are {AXES}")
    require(len(set(seen)) == len(seen), "order", "an axis appears twice in order+planes", seen)
    for a in ("B", "N", "H", "D"):
        require(a in lay.order, "order", f"axis {a} must be in the memory order", lay.order)
    for a in lay.planes:
        require(a in PLANE_AXES, "planes", f"only {PLANE_AXES} may be plane axes", a)
    sizes = lay.sizes
    extra = set(sizes) - set(seen)
    require(not extra, "sizes", "names axes not in the layout", sorted(map(str, extra)))
    for a in seen:
        require(a in sizes, f"sizes.{a}", "must be a positive int (missing)")
    if "KV" in seen:
        require(sizes["KV"] == 2, "sizes.KV", "must be 2 (key, value)", sizes["KV"])
    for a, v in (lay.extents or {}).items():
        require(a in lay.order, f"extents.{a}", "only memory-order axes have extents")
        require(v >= sizes[a], f"extents.{a}", f"must be an int >= {sizes[a]}", v)

    def extent(a):
        return (lay.extents or {}).get(a, sizes[a])

    if lay.strides is None:
        stride, s = {}, isz
        for a in reversed(lay.order):
            stride[a] = s
            s = checked_bytes(s * extent(a), "sizes", f"the bytes spanned by axes up to {a}")
    else:
        require(set(lay.strides) == set(lay.order), "strides",
                f"must give a byte stride for each of {lay.order}",
                sorted(map(str, lay.strides)))
        stride = dict(lay.strides)
        for a, s in stride.items():
            require(s % isz == 0, f"strides.{a}",
                    f"must be a positive multiple of itemsize {isz}", s)
        # Memory order is `order`: each axis must step over the whole of the next one.
        for outer, inner in zip(lay.order, lay.order[1:]):
            need = extent(inner) * stride[inner]
            require(stride[outer] >= need, f"strides.{outer}",
                    f"overlaps axis {inner} (needs >= {need})", stride[outer])
    stride = FrozenDict((a, stride[a]) for a in lay.order)
    natural = checked_bytes(sum((extent(a) - 1) * stride[a] for a in lay.order) + isz,
                     "strides" if lay.strides is not None else "sizes",
                     "the bytes one plane spans")
    if lay.plane_bytes is None:
        nbytes = natural
    else:
        require(isinstance(lay.plane_bytes, int), "plane_bytes",
                "must be one int in the axis form (every plane alike)", lay.plane_bytes)
        nbytes = lay.plane_bytes
        require(nbytes >= natural, "plane_bytes",
                f"must be an int >= {natural} (the bytes the strides reach)", nbytes)
    nplanes = math.prod(sizes[a] for a in lay.planes)
    checked_bytes(nplanes * nbytes, "sizes", f"the bytes of all {nplanes} planes")
    _check_folds(lay, stride, extent)  # before the folds are used to group axes
    groups = _view_groups(lay)
    h_group = next(i for i, g in enumerate(groups) if "H" in g)
    if lay.packing is not None:
        e = math.prod(extent(a) for a in groups[h_group])
        require(e % lay.packing == 0, "packing",
                f"must divide the {'*'.join(groups[h_group])} dimension ({e}); heads are "
                f"never padded silently", lay.packing)
    shape, strides, axes = [], [], []
    for i, g in enumerate(groups):
        e = math.prod(extent(a) for a in g)
        s = stride[g[-1]] // isz
        axes.append(g)
        if lay.packing is not None and i == h_group:
            shape += [e // lay.packing, lay.packing]
            strides += [s * lay.packing, s]
            axes.append(("p",))
        else:
            shape.append(e)
            strides.append(s)
    return AxisGeometry(stride, natural, nbytes, nplanes, tuple(shape), tuple(strides),
                        tuple(axes))


def _view_groups(lay) -> list[tuple[str, ...]]:
    groups, i = [], 0
    starts = {f[0]: f for f in lay.folds}
    while i < len(lay.order):
        g = starts.get(lay.order[i], (lay.order[i],))
        groups.append(g)
        i += len(g)
    return groups


def _check_folds(lay, stride, extent):
    used = set()
    for f in lay.folds:
        require(len(f) >= 2, "folds", "a fold merges at least two axes", f)
        for a in f:
            require(a in lay.order and a not in used, "folds",
                    f"axis {a!r} is not in order or folded twice", f)
            used.add(a)
        i = lay.order.index(f[0])
        require(tuple(lay.order[i:i + len(f)]) == f, "folds",
                "folded axes must be consecutive in the memory order", f)
        for outer, inner in zip(f, f[1:]):
            require(stride[outer] == extent(inner) * stride[inner], "folds",
                    f"{outer} and {inner} are not contiguous, cannot fold", f)


def axis_components(lay, geo: AxisGeometry) -> tuple:
    """The components an axis-form layout means: ``key`` and ``value`` (``latent`` when
    there is no KV axis), each with the layout's dtype and ``D`` elements, the strides of
    the memory order (``D`` is ``E``), the value at one ``KV`` stride after the key (or in
    the next plane along ``KV``), and ``L`` on planes where it is a plane axis."""
    sizes = lay.sizes
    strides = FrozenDict(("E" if a == "D" else a, s) for a, s in geo.stride.items()
                         if a != "KV")
    # plane numbering: row-major over the plane axes
    pstep, step = {}, 1
    for a in reversed(lay.planes):
        pstep[a] = step
        step *= sizes[a]
    plane_strides = FrozenDict({"L": pstep["L"]} if "L" in pstep else {})
    names = ("key", "value") if "KV" in sizes else ("latent",)
    out = []
    for kv, name in enumerate(names):
        offset = kv * geo.stride["KV"] if "KV" in geo.stride else 0
        plane = kv * pstep.get("KV", 0)
        out.append(Component(name=name, dtype=lay.dtype, count=sizes["D"], strides=strides,
                             offset=offset, plane=plane, plane_strides=plane_strides))
    return tuple(out)
