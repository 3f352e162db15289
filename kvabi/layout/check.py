"""The checks of a layout's components against its sizes and each other (``specs/layout.md``,
*Components* and *Untrusted input*): names that go together, axes, bounds inside planes,
no element reached twice, no two components sharing a byte, everything in int64.

Overlap is decided by a rule stated in the spec, sound for any input and cheap (a few
integer operations per pair of components, whatever the sizes): each component must be
*nested* (its axes sorted by stride, each stride steps over everything inside it), and
two components sharing a plane must peel apart: while their outermost axes have the same
stride and size, and what lies inside one entry of that axis fits in the stride for both,
only equal indices can meet, so the axis is dropped from both; then their hulls (first to
last byte) must not intersect.  Layouts it cannot prove disjoint are refused.
"""
from __future__ import annotations

import attrs
import numpy as np

from ..util.coerce import as_int, checked_bytes
from ..util.errors import KVABIError
from ..util.frozen import FrozenDict
from .component import DATA, NAMES, Component, check_component, component_field

#: most components in one layout
MAX_COMPONENTS = 16
#: most planes a component layout whose planes differ in size may have (every plane of one
#: size: as many as int64 allows)
MAX_LISTED_PLANES = 1 << 16
#: axes of a component layout's sizes
SIZE_AXES = ("L", "B", "N", "H")


@attrs.frozen
class Placed:
    """Derived facts of one component in a layout: its in-plane axes with more than one
    index as (stride, count), outermost first, and the bytes its hull spans from its
    offset (``span``), and the planes it reaches."""

    component: Component
    axes: tuple
    span: int
    planes: tuple


@attrs.frozen
class Checked:
    """What :func:`check_components` derives: the components in order, by name, their
    placements, the number of planes and their sizes in bytes (``uniform``: every plane
    that size; else ``listed``, one per plane)."""

    components: tuple
    by_name: FrozenDict
    placed: FrozenDict
    num_planes: int
    uniform: int | None
    listed: tuple | None

    def plane_size(self, i: int) -> int:
        return self.uniform if self.uniform is not None else self.listed[i]

    def plane_sizes(self) -> tuple:
        return self.listed if self.listed is not None else (self.uniform,) * self.num_planes


def as_components(x) -> tuple:
    """A tuple of :class:`Component` from a list of components or JSON objects (errors name
    ``components[i]`` or ``components.<name>``)."""
    if isinstance(x, (str, bytes)) or not isinstance(x, (list, tuple)):
        raise KVABIError(f"components: must be a list of components, got {x!r:.80}")
    if not x:
        raise KVABIError("components: must hold at least one component")
    if len(x) > MAX_COMPONENTS:
        raise KVABIError(f"components: {len(x)} components, more than {MAX_COMPONENTS}")
    return tuple(check_component(c, component_field(c, i)) for i, c in enumerate(x))


def _names(comps) -> FrozenDict:
    by = {}
    for c in comps:
        if c.name in by:
            raise KVABIError(f"components.{c.name}: appears twice")
        by[c.name] = c
    names = set(by)
    if "key" in names or "value" in names:
        for need in ("key", "value"):
            if need not in names:
                raise KVABIError(f"components.{need}: missing (a layout holding keys holds "
                                 f"values, and the reverse)")
        for other in ("latent", "rope"):
            if other in names:
                raise KVABIError(f"components.{other}: a layout holds key/value or an MLA "
                                 f"latent, not both")
    elif "latent" not in names:
        raise KVABIError("components: must hold key and value, or latent (MLA)")
    for c in comps:
        if c.is_scale:
            base = by.get(c.base)
            if base is None:
                raise KVABIError(f"components.{c.name}: scales {c.base}, which the layout "
                                 f"does not hold")
            if base.count % c.count:
                raise KVABIError(f"components.{c.name}.count: {c.count} scales must divide "
                                 f"the {base.count} elements of {c.base}")
            for a in SIZE_AXES:
                if c.varies(a) and not base.varies(a):
                    raise KVABIError(f"components.{c.name}: varies along {a}, but "
                                     f"{c.base} does not (a scale is as fine as its data "
                                     f"at most)")
    return FrozenDict((n, by[n]) for n in NAMES if n in by)


def _placed(c: Component, sizes, nplanes_hint) -> Placed:
    f = f"components.{c.name}"
    for a in c.strides:
        if a != "E" and a not in sizes and a != "L":
            raise KVABIError(f"{f}.strides.{a}: the layout has no axis {a}")
    for a in ("N", "H"):
        if c.name in DATA and sizes[a] > 1 and not c.varies(a):
            raise KVABIError(f"{f}.strides: must give a stride for {a} ({c.name} is per "
                             f"token and head)")
    nl = sizes.get("L", 1)
    if nl > 1 and not c.varies("L"):
        raise KVABIError(f"{f}: must vary along L (each of the {nl} layers holds its own)")
    count = {a: (c.units if a == "E" else sizes.get(a, 1)) for a in c.strides}
    axes = sorted(((s, count[a], a) for a, s in c.strides.items() if count[a] > 1),
                  reverse=True)
    # nested: each stride steps over everything inside it (no element reached twice)
    inner = c.unit
    for s, n, a in reversed(axes):
        if s < inner:
            raise KVABIError(f"{f}.strides.{a}: {s} overlaps the axes inside it (needs >= "
                             f"{inner})")
        inner = checked_bytes(inner + (n - 1) * s, f"{f}.strides", "the bytes one index spans")
    span = inner
    checked_bytes(c.offset + span, f"{f}.offset", "the component's last byte")
    ps = c.plane_strides.get("L")
    last = c.plane + (nl - 1) * ps if ps else c.plane
    if last >= nplanes_hint:
        raise KVABIError(f"{f}.plane: reaches plane {last}, but the layout has "
                         f"{nplanes_hint} planes")
    planes = (c.plane, ps or 1, nl if ps else 1)  # first, step, count
    return Placed(c, tuple((s, n) for s, n, _ in axes), span, planes)


def planes_reached(p: Placed) -> np.ndarray:
    """The planes a component reaches, as int64."""
    first, step, n = p.planes
    return first + step * np.arange(n, dtype=np.int64)


def _common_plane(a: Placed, b: Placed):
    """A plane both reach, or None: where the arithmetic progressions of their
    planes meet (exact integer arithmetic, whatever the layer count)."""
    (a0, da, na), (b0, db, nb) = a.planes, b.planes
    g, p, q = _egcd(da, db)
    diff = b0 - a0
    if diff % g:
        return None
    sa, sb = db // g, da // g  # i = i0 + k * sa, j = j0 + k * sb solve a0 + i*da = b0 + j*db
    i0, j0 = p * (diff // g), -q * (diff // g)
    lo = max(-(i0 // sa), -(j0 // sb))
    hi = min((na - 1 - i0) // sa, (nb - 1 - j0) // sb)
    if lo > hi:
        return None
    return a0 + (i0 + lo * sa) * da


def _egcd(x: int, y: int):
    """(g, p, q) with p*x + q*y == g == gcd(x, y), for x, y >= 1."""
    p0, q0, p1, q1 = 1, 0, 0, 1
    while y:
        k = x // y
        x, y = y, x - k * y
        p0, p1 = p1, p0 - k * p1
        q0, q1 = q1, q0 - k * q1
    return x, p0, q0


def _disjoint(a: Placed, b: Placed) -> bool:
    """The peel rule (module docstring): True when no byte of ``a`` is a byte of ``b`` in
    a plane both reach."""
    ax, bx = list(a.axes), list(b.axes)
    oa, ob = a.component.offset, b.component.offset
    sa, sb = a.span, b.span
    while True:
        if oa + sa <= ob or ob + sb <= oa:
            return True
        if not ax or not bx or ax[0] != bx[0]:
            return False
        s, n = ax[0]
        ra, rb = sa - (n - 1) * s, sb - (n - 1) * s  # one entry of the axis
        if max(oa + ra, ob + rb) - min(oa, ob) > s:
            return False
        ax.pop(0)
        bx.pop(0)
        sa, sb = ra, rb


def check_components(components, sizes, plane_bytes) -> Checked:
    """Check ``components`` (a tuple of :class:`Component`) against ``sizes`` (L, B, N, H)
    and ``plane_bytes`` (None: each plane as large as its furthest byte; an int: every
    plane; a tuple: one per plane).  KVABIError naming the field otherwise."""
    by_name = _names(components)
    if isinstance(plane_bytes, tuple):
        if not 1 <= len(plane_bytes) <= MAX_LISTED_PLANES:
            raise KVABIError(f"plane_bytes: must list 1 to {MAX_LISTED_PLANES} planes, got "
                             f"{len(plane_bytes)}")
        hint = len(plane_bytes)
    else:
        hint = 2**63 if isinstance(plane_bytes, int) else MAX_LISTED_PLANES
    placed = {c.name: _placed(c, sizes, hint) for c in by_name.values()}
    nplanes = hint if isinstance(plane_bytes, tuple) else \
        1 + max(p.planes[0] + p.planes[1] * (p.planes[2] - 1) for p in placed.values())
    uniform = listed = None
    if isinstance(plane_bytes, int):
        uniform = plane_bytes
        for n, p in placed.items():
            need = p.component.offset + p.span
            if need > uniform:
                raise KVABIError(f"components.{n}: reaches byte {need} of its planes, which "
                                 f"plane_bytes makes {uniform} bytes (it leaves the plane)")
    else:
        ends = np.zeros(nplanes, np.int64)
        for p in placed.values():
            np.maximum.at(ends, planes_reached(p), p.component.offset + p.span)
        if plane_bytes is None:
            empty = np.flatnonzero(ends == 0)
            if empty.size:
                raise KVABIError(f"plane_bytes: plane {int(empty[0])} holds no component; "
                                 f"give the plane sizes")
            listed = tuple(int(e) for e in ends)
        else:
            listed = plane_bytes
            short = np.flatnonzero(np.asarray(listed, np.int64) < ends)
            if short.size:
                q = int(short[0])
                who = next(n for n, p in placed.items() if q in planes_reached(p) and
                           p.component.offset + p.span > listed[q])
                raise KVABIError(f"components.{who}: reaches byte {int(ends[q])} of plane "
                                 f"{q}, which plane_bytes makes {listed[q]} bytes (it "
                                 f"leaves the plane)")
        if len(set(listed)) == 1:
            uniform, listed = listed[0], None
    total = uniform * nplanes if uniform is not None else sum(listed)
    checked_bytes(total, "plane_bytes", f"the bytes of all {nplanes} planes")
    items = list(placed.values())
    for i, a in enumerate(items):
        for b in items[i + 1:]:
            q = _common_plane(a, b)
            if q is not None and not _disjoint(a, b):
                raise KVABIError(f"components.{b.component.name}: may share bytes with "
                                 f"components.{a.component.name} in plane {q} (offsets "
                                 f"{a.component.offset} and {b.component.offset}; see "
                                 f"layout.md, Components, for the rule)")
    return Checked(tuple(by_name.values()), by_name, FrozenDict(placed), nplanes, uniform,
                   listed)


def check_layer(layer, layout) -> int:
    """``layer`` as an index on ``layout``'s L axis (the layers that hold a cache; a
    KV-sharing layer passes its target's index), or KVABIError ``"layer: 2 out of range [0,
    2)"``: the one wording of every backend and of the layout's own views."""
    if type(layer) is int and 0 <= layer < layout.num_layers:  # the common case: one compare
        return layer
    v = as_int(layer, "layer")
    if not 0 <= v < layout.num_layers:
        raise KVABIError(f"layer: {v} out of range [0, {layout.num_layers})")
    return v
