"""Where every byte of a KV cache lives: the physical layout descriptor (``specs/layout.md``).

A :class:`Layout` is a set of *components* (``key``, ``value``, ``latent``, ``rope`` and
their ``*_scale``), each with its own dtype, element count and placement (plane, byte
offset, byte strides over ``L, B, N, H`` and its element axis ``E``), over planes of given
sizes.  Keys and values may use different strides, scales may sit inline in the same
record or in a plane of their own, and several dtypes may share one record.

The *axis form* (one memory order that keys and values share, with padding, folds and
packing: every 1.x layout) is shorthand for the two-component (MLA: one) case; it also
fixes the tensor a backend sees per plane.  A layout is a pure description: memory access
(allocation, views) lives with :class:`kvabi.KVCache`.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Iterable

import attrs
import numpy as np

from ..model.shard import Shard, check_layout_shard, shard_field
from ..util.coerce import as_int, int_array
from ..util.dtypes import unit_bytes
from ..util.errors import KVABIError
from ..util.frozen import FrozenDict
from .axes import AXES, PLANE_AXES, AxisGeometry, axis_components, axis_geometry
from .check import SIZE_AXES, Checked, as_components, check_components
from .component import KV_NAMES, NAMES, Component
from .json_form import layout_from_json, layout_to_dict
from .presets import build_preset
from .regions import MAX_BLOCK_REGIONS, block_regions

__all__ = ["AXES", "MAX_BLOCK_REGIONS", "PLANE_AXES", "Component", "Layout", "check_layout"]

_ARG = {"L": "layer", "B": "block", "KV": "kv", "N": "token", "H": "head", "D": "dim",
        "E": "index"}


def _axis_order(a):
    return AXES.index(a) if a in AXES else 99


def _axis_list(field, optional=False):
    """Converter: a list or tuple of axis names (a bare string is not one)."""
    def convert(x):
        if optional and x is None:
            return None
        if isinstance(x, (str, bytes)) or not isinstance(x, (list, tuple)) or \
                not all(isinstance(a, str) for a in x):
            raise KVABIError(f"{field}: must be a list of axis names, got {x!r:.80}")
        return tuple(x)

    return convert


def _axis_ints(field, lo, optional=True):
    """Converter: None (where ``optional``), or a mapping axis -> int >= ``lo`` (each
    value coerced by name, ``field.axis``) sorted in AXES order."""
    def convert(x):
        if x is None and optional:
            return None
        if not isinstance(x, Mapping):
            raise KVABIError(f"{field}: must be an object of axis -> integer, got {x!r:.80}")
        items = sorted(x.items(), key=lambda kv: _axis_order(kv[0]))
        return FrozenDict((a, as_int(v, f"{field}.{a}", lo=lo)) for a, v in items)

    return convert


def _extents(x):
    e = _axis_ints("extents", 1)(x)
    return e or None


def _folds(x):
    if isinstance(x, (str, bytes)) or not isinstance(x, (list, tuple)):
        raise KVABIError(f"folds: must be a list of lists of axis names, got {x!r:.80}")
    return tuple(_axis_list(f"folds[{i}]")(f) for i, f in enumerate(x))


def _plane_bytes(x):
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return tuple(as_int(v, f"plane_bytes[{i}]", lo=1) for i, v in enumerate(x))
    return as_int(x, "plane_bytes", lo=1)


def _packing(x):
    return None if x is None else as_int(x, "packing", lo=1)


def _name(x):
    if x is not None and not isinstance(x, str):
        raise KVABIError(f"name: must be a string or null, got {x!r:.80}")
    return x


def _given(x):
    return None if x is None else as_components(x)


def _default_dtype(self):
    # component form: the dtype of the data the cache holds (key, or latent)
    if self.order is None and self._given:
        for c in self._given:
            if c.name in ("key", "latent"):
                return c.dtype
    return None


def _axes(self) -> AxisGeometry | None:
    if self.order is None:
        return None
    if self._given is not None:
        raise KVABIError("components: give the axis form (order, ...) or components, not "
                         "both")
    return axis_geometry(self)


def _components(self) -> tuple:
    if self._axes is not None:
        return axis_components(self, self._axes)
    if self._given is None:
        raise KVABIError("components: missing (a layout has components, or the axis form's "
                         "order)")
    for f, empty in (("planes", ()), ("extents", None), ("strides", None), ("folds", ()),
                     ("packing", None)):
        if getattr(self, f) != empty:
            raise KVABIError(f"{f}: belongs to the axis form; a component layout places "
                             f"each component itself")
    for a in self.sizes:
        if a not in SIZE_AXES:
            raise KVABIError(f"sizes.{a}: a component layout's sizes are "
                             f"{', '.join(SIZE_AXES)} (each component counts its elements)")
    for a in ("B", "N", "H"):
        if a not in self.sizes:
            raise KVABIError(f"sizes.{a}: must be a positive int (missing)")
    # one order (the vocabulary's) whatever order they came in: equal layouts compare equal
    return tuple(sorted(self._given, key=lambda c: NAMES.index(c.name)))


def _checked(self) -> Checked:
    sizes = {a: self.sizes.get(a, 1) for a in SIZE_AXES}
    pb = self._axes.plane_nbytes if self._axes is not None else self.plane_bytes
    chk = check_components(self.components, sizes, pb)
    check_layout_shard(self.shard, self.sizes["H"])
    data = chk.by_name.get("key") or chk.by_name["latent"]
    if self.dtype != data.dtype:
        raise KVABIError(f"dtype: {self.dtype!r:.40} disagrees with components.{data.name}"
                         f".dtype {data.dtype!r}")
    return chk


@attrs.frozen(kw_only=True, eq=True, hash=False)
class Layout:
    """An immutable, validated physical layout.  Build with :meth:`preset`, the axis form
    (``order=``, ``sizes=``, ``dtype=``, ...) or components (``components=``, ``sizes=``
    over ``L, B, N, H``, optional ``plane_bytes``).

    Every size, stride, offset and byte count a layout can produce fits in int64, every
    element lies inside its plane, and no two elements share a byte: a layout for which
    any of this cannot be shown is refused when built (``specs/layout.md``).
    """

    sizes: Mapping[str, int] = attrs.field(converter=_axis_ints("sizes", 1, optional=False))
    order: tuple[str, ...] | None = attrs.field(default=None,
                                                converter=_axis_list("order", optional=True))
    planes: tuple[str, ...] = attrs.field(default=(), converter=_axis_list("planes"))
    extents: Mapping[str, int] | None = attrs.field(default=None, converter=_extents)
    strides: Mapping[str, int] | None = attrs.field(default=None,
                                                    converter=_axis_ints("strides", 1))
    plane_bytes: int | tuple[int, ...] | None = attrs.field(default=None,
                                                            converter=_plane_bytes)
    folds: tuple[tuple[str, ...], ...] = attrs.field(default=(), converter=_folds)
    packing: int | None = attrs.field(default=None, converter=_packing)
    name: str | None = attrs.field(default=None, converter=_name)
    #: which global KV heads the layout holds (None: all of them, in order); see
    #: kvabi.model.shard (checked against sizes.H once the sizes are converted)
    shard: Shard | None = attrs.field(default=None, converter=shard_field)
    # the components as given (component form); `components` below holds them checked
    _given: tuple | None = attrs.field(default=None, alias="components", converter=_given,
                                       eq=False, repr=False)
    dtype: str | None = attrs.field(default=attrs.Factory(_default_dtype, takes_self=True))
    # Derived once at construction (exact, checked): the axis form's geometry, the
    # components, and what their check derives (placements, plane sizes).
    _axes: AxisGeometry | None = attrs.field(
        init=False, eq=False, repr=False, default=attrs.Factory(_axes, takes_self=True))
    components: tuple[Component, ...] = attrs.field(
        init=False, default=attrs.Factory(_components, takes_self=True))
    _chk: Checked = attrs.field(init=False, eq=False, repr=False,
                                default=attrs.Factory(_checked, takes_self=True))

    # -- the two forms -------------------------------------------------------------------
    @property
    def is_axis_form(self) -> bool:
        """Whether the layout is stated in the axis form (one memory order for keys and
        values, and the tensor a backend sees per plane)."""
        return self.order is not None

    def component(self, name: str) -> Component:
        """The component called ``name``; KVABIError when the layout has none."""
        c = self._chk.by_name.get(name) if isinstance(name, str) else None
        if c is None:
            raise KVABIError(f"component: {name!r:.40} is not in this layout (it holds "
                             f"{', '.join(self._chk.by_name)})")
        return c

    @property
    def component_names(self) -> tuple[str, ...]:
        return tuple(self._chk.by_name)

    def component_form(self) -> "Layout":
        """The same placement stated by components (the axis form's tensor view dropped)."""
        if not self.is_axis_form:
            return self
        return Layout(sizes={a: self.size(a) for a in SIZE_AXES if a != "L" or
                             self.num_layers > 1},
                      components=self.components,
                      plane_bytes=self.plane_nbytes if self.uniform_planes else
                      self.plane_sizes,
                      name=self.name, shard=self.shard)

    # -- sizes and strides ---------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        """Bytes of one element of :attr:`dtype` (one storage byte for packed dtypes)."""
        return unit_bytes(self.dtype)

    def _data(self) -> tuple[Component, ...]:
        by = self._chk.by_name
        return (by["key"], by["value"]) if "key" in by else (by["latent"],)

    def size(self, axis: str) -> int:
        """Logical size of ``axis`` (1 when the layout lacks it); in the component form
        ``D`` is the key's (latent's) element count and ``KV`` 2 where there are values."""
        if self.order is None:
            if axis == "D":  # MLA: the latent and its rope part make one head
                rope = self._chk.by_name.get("rope")
                return self._data()[0].count + (rope.count if rope is not None else 0)
            if axis == "KV":
                return 2 if self.has_kv else 1
        return self.sizes.get(axis, 1)

    def extent(self, axis: str) -> int:
        """Physical (padded) size of a memory-order axis (the component form pads
        nothing per axis: its size)."""
        if self.order is None:
            return self.size(axis)
        return (self.extents or {}).get(axis, self.sizes[axis])

    def stride(self, axis: str) -> int:
        """Byte stride of ``axis``: of the memory order (axis form), or the stride the
        data components share (component form: ``D`` is their ``E``); KVABIError where
        they differ or the axis has none."""
        if self._axes is not None:
            s = self._axes.stride.get(axis)
            if s is None:
                raise KVABIError(f"axis: {axis!r} is not in the memory order {self.order}")
            return s
        a = "E" if axis == "D" else axis
        got = {c.name: c.strides.get(a) for c in self._data()}
        vals = set(got.values())
        if None in vals or len(vals) != 1:
            raise KVABIError(f"axis: {axis!r} has no one stride in "
                             f"{self.name or 'this layout'} (" +
                             ", ".join(f"{n}: {s}" for n, s in got.items()) + ")")
        return vals.pop()

    @property
    def num_layers(self) -> int:
        return self.size("L")

    @property
    def num_blocks(self) -> int:
        return self.sizes["B"]

    @property
    def has_kv(self) -> bool:
        """False for MLA layouts (a latent, no key/value)."""
        return "value" in self._chk.by_name

    @property
    def num_planes(self) -> int:
        return self._chk.num_planes

    @property
    def plane_sizes(self) -> tuple[int, ...]:
        """Bytes of each plane, in plane order."""
        return self._chk.plane_sizes()

    def plane_size(self, i: int) -> int:
        """Bytes of plane ``i``."""
        return self._chk.plane_size(i)

    @property
    def uniform_planes(self) -> bool:
        """Whether every plane has the same size (:attr:`plane_nbytes`)."""
        return self._chk.uniform is not None

    @property
    def plane_nbytes(self) -> int:
        """Bytes of each plane (the largest, where component planes differ in size)."""
        c = self._chk
        return c.uniform if c.uniform is not None else max(c.listed)

    @property
    def total_nbytes(self) -> int:
        """Bytes of all planes together (fits int64: checked at construction)."""
        c = self._chk
        return c.uniform * c.num_planes if c.uniform is not None else sum(c.listed)

    def _span(self) -> int:
        """Bytes from a plane's first byte to the end of its furthest element."""
        if self._axes is not None:
            return self._axes.natural
        return max(p.component.offset + p.span for p in self._chk.placed.values())

    @property
    def is_c_contiguous(self) -> bool:
        """Each plane is exactly a C-contiguous array of :attr:`plane_shape` (axis form;
        component planes are bytes addressed by components: False)."""
        if self._axes is None:
            return False
        n = int(np.prod(self.plane_shape, dtype=object)) * self.itemsize
        return self.plane_nbytes == n and self.plane_strides == _c_strides(self.plane_shape)

    # -- the tensor a backend sees (axis form) ---------------------------------------------
    def _axis_only(self, what):
        if self._axes is None:
            raise KVABIError(f"layout: {what} belongs to the axis form; "
                             f"{self.name or 'this layout'} is stated by components (read "
                             f"it through cache.component_view / kv_view)")
        return self._axes

    @property
    def view_axes(self) -> tuple[tuple[str, ...], ...]:
        """Logical axes of each dimension of a plane tensor; packing adds a ``("p",)`` dim."""
        return self._axis_only("view_axes").view_axes

    @property
    def plane_shape(self) -> tuple[int, ...]:
        """Shape of each plane tensor as the backend sees it (axis form: extents, folds,
        packing; component form: a flat array of :attr:`dtype` over the (largest) plane's
        bytes, rounded up to whole elements)."""
        if self._axes is None:
            return (-(-self.plane_nbytes // self.itemsize),)
        return self._axes.shape

    @property
    def plane_strides(self) -> tuple[int, ...]:
        """Element strides of each plane tensor's dimensions."""
        if self._axes is None:
            return (1,)
        return self._axes.elem_strides

    # -- addressing ----------------------------------------------------------------------
    def _plane_of(self, layer, kv):
        """Plane of (layer, kv) of the data components (vectorized, indices trusted)."""
        c = self._data()[kv] if np.ndim(kv) == 0 else None
        if c is not None:
            ps = c.plane_strides.get("L", 0)
            return np.int64(c.plane) + np.asarray(layer, np.int64) * ps
        data = self._data()
        kv = np.asarray(kv, np.int64)
        base = np.array([d.plane for d in data], np.int64)[kv]
        step = np.array([d.plane_strides.get("L", 0) for d in data], np.int64)[kv]
        return base + np.asarray(layer, np.int64) * step

    def plane_index(self, layer=0, kv=0):
        """Index of the plane holding (layer, kv); vectorized over integer arrays."""
        vals = self._indices({"L": layer, "KV": kv})
        p = self._plane_of(vals["L"], vals["KV"])
        return p if np.ndim(p) else int(p)

    def _indices(self, args: dict, sizes: dict | None = None) -> dict:
        """Strict int64 arrays of logical indices, each inside its axis (KVABIError naming
        the argument otherwise: no float, no bool, no wrap)."""
        vals = {}
        for a, v in args.items():
            v = int_array(v, _ARG[a], ndim=None)
            hi = sizes[a] if sizes and a in sizes else self.size(a)
            if v.size and (v.min() < 0 or v.max() >= hi):
                bad = v[(v < 0) | (v >= hi)].ravel()[0]
                raise KVABIError(f"{_ARG[a]}: {int(bad)} out of range [0, {hi})")
            vals[a] = v
        return vals

    def element_offset(self, component: str, *, layer=0, block=0, token=0, head=0,
                       index=0):
        """(plane, byte offset within the plane) of element ``index`` of ``component`` at
        (layer, block, token, head): the byte holding it (for a packed dtype the element
        is that byte's low nibble when ``index`` is even, else its high nibble).

        Arguments broadcast as integer arrays; floats, bools and out-of-range indices
        raise KVABIError.  Indices along axes the component does not vary along are
        checked and ignored.  Offsets are int64 and always inside the plane."""
        return self._offset(self.component(component), layer, block, token, head, index,
                            "index")

    def _offset(self, c, layer, block, token, head, index, index_name):
        _ARG_E = {"E": index_name}
        vals = {}
        for a, v in (("L", layer), ("B", block), ("N", token), ("H", head), ("E", index)):
            arg = _ARG_E.get(a, _ARG[a])
            v = int_array(v, arg, ndim=None)
            hi = c.count if a == "E" else self.size(a)
            if v.size and (v.min() < 0 or v.max() >= hi):
                bad = v[(v < 0) | (v >= hi)].ravel()[0]
                raise KVABIError(f"{arg}: {int(bad)} out of range [0, {hi})")
            vals[a] = v
        vals["E"] = vals["E"] // (c.count // c.units)
        off = c.offset + sum((vals[a] * s for a, s in c.strides.items()), np.int64(0))
        ps = c.plane_strides.get("L")
        plane = np.int64(c.plane) + (vals["L"] * ps if ps else np.int64(0))
        if np.ndim(off) == 0 and np.ndim(plane) == 0:
            return int(plane), int(off)
        plane, off = np.broadcast_arrays(plane, off)
        return plane.astype(np.int64), off.astype(np.int64)

    def byte_offset(self, layer=0, block=0, kv=0, token=0, head=0, dim=0):
        """(plane, byte offset within the plane) of one logical element of the keys
        (``kv`` 0), values (1) or MLA latent: :meth:`element_offset` of that component.

        Arguments broadcast as integer arrays (lists, numpy, torch); floats, bools and
        out-of-range indices raise KVABIError."""
        k = int_array(kv, "kv", ndim=None)
        hi = 2 if self.has_kv else 1
        if k.size and (k.min() < 0 or k.max() >= hi):
            raise KVABIError(f"kv: {int(k[(k < 0) | (k >= hi)].ravel()[0])} out of range "
                             f"[0, {hi})")
        names = KV_NAMES if self.has_kv else ("latent",)
        comps = [self.component(n) for n in names]
        rope = self._chk.by_name.get("rope")
        if rope is not None:  # MLA head dims: the latent's, then the rope part's
            lat = comps[0]
            d = int_array(dim, "dim", ndim=None)
            hi = lat.count + rope.count
            if d.size and (d.min() < 0 or d.max() >= hi):
                raise KVABIError(f"dim: {int(d[(d < 0) | (d >= hi)].ravel()[0])} out of "
                                 f"range [0, {hi})")
            in_rope = d >= lat.count
            p0, o0 = self._offset(lat, layer, block, token, head, np.where(in_rope, 0, d),
                                  "dim")
            p1, o1 = self._offset(rope, layer, block, token, head,
                                  np.where(in_rope, d - lat.count, 0), "dim")
            if np.ndim(o0) == 0 and np.ndim(o1) == 0:
                return (p1, o1) if bool(in_rope) else (p0, o0)
            return (np.where(in_rope, p1, p0).astype(np.int64),
                    np.where(in_rope, o1, o0).astype(np.int64))
        if k.ndim == 0 or not self.has_kv:
            c = comps[int(k.ravel()[0]) if k.size else 0]
            return self._offset(c, layer, block, token, head, dim, "dim")
        # both components at once: select per element
        (p0, o0), (p1, o1) = (self._offset(c, layer, block, token, head, dim, "dim")
                              for c in comps)
        shape = np.broadcast_shapes(k.shape, np.shape(o0), np.shape(o1))
        sel = np.broadcast_to(k, shape) == 1
        return (np.where(sel, p1, p0).astype(np.int64),
                np.where(sel, o1, o0).astype(np.int64))

    # -- block regions -------------------------------------------------------------------
    @property
    def is_block_contiguous(self) -> bool:
        """Each block (all layers and components of the plane) is one byte range of each
        plane: ``B`` is every component's outermost axis and they share its stride."""
        strides = {p.axes[0] if p.axes else None for p in self._chk.placed.values()}
        sB = {c.strides["B"] for c in self.components}
        return len(sB) == 1 and all(s is not None and s[0] == next(iter(sB)) for s in strides)

    def block_regions(self, block_ids, layers: Iterable[int] | None = None):
        """Fewest contiguous byte regions ``(plane, offset, nbytes)`` holding every byte of
        every component of the blocks (of ``layers``, default all).

        A region holds no byte of an element of another block or layer; it may hold
        padding between elements (regions of adjacent blocks merge across the padding
        between them).  Sorted by plane and offset.  Time and memory are proportional
        to the pieces enumerated (blocks asked times the planes and the axes outside
        ``B``, per component), never to ``num_blocks``."""
        return block_regions(self, block_ids, layers)

    # -- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The descriptor as a JSON object (``specs/layout.schema.json``)."""
        return layout_to_dict(self)

    def to_json(self) -> str:
        """The versioned JSON descriptor (``specs/layout.schema.json``)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def fingerprint(self) -> str:
        """A stable digest of where every byte lives (``specs/layout.md``, *Fingerprint*):
        equal for layouts that place every element of the same dtype and heads at the same
        (plane, byte offset), whatever their name, folds or padding; different otherwise.
        Usable as a handshake field, a namespace key and a label."""
        from .fingerprint import fingerprint

        return fingerprint(self)

    @classmethod
    def from_json(cls, text, *, max_bytes: int | None = None) -> "Layout":
        """Parse an untrusted descriptor (2.x, or a 1.x one).  Refuses another ABI major,
        accepts a newer minor (ignoring unknown fields); any malformed field raises
        KVABIError naming it.  ``max_bytes`` bounds the bytes of the whole descriptor (all
        planes together, e.g. the receiver's buffers); the text goes through
        :func:`kvabi.util.safe_json.loads`."""
        return layout_from_json(cls, text, max_bytes=max_bytes)

    # -- presets -------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, spec, num_blocks: int, num_layers: int = 1) -> "Layout":
        """A named layout of the anchors for ``spec`` (see :data:`kvabi.layout.presets.PRESETS`)."""
        return build_preset(cls, name, spec, num_blocks, num_layers)


def _c_strides(shape) -> tuple[int, ...]:
    out, s = [], 1
    for e in reversed(shape):
        out.append(s)
        s *= e
    return tuple(reversed(out))


def check_layout(value, field: str = "layout") -> "Layout":
    """``value`` when it is a :class:`Layout`; else KVABIError naming ``field`` (with a
    hint for a preset name, the usual mistake)."""
    if not isinstance(value, Layout):
        hint = " (a preset name? Layout.preset(name, spec, num_blocks) builds one)" \
            if isinstance(value, str) else ""
        raise KVABIError(f"{field}: must be a kvabi.Layout, got {type(value).__name__}{hint}")
    return value
