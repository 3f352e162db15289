"""Where every byte of a KV cache lives: the physical layout descriptor (``specs/layout.md``).

Logical axes: ``L`` layer, ``B`` block, ``KV`` (0 key, 1 value; absent for MLA), ``N`` token
within the block, ``H`` KV head, ``D`` element within the head.  A :class:`Layout` gives the
memory order of the axes inside one tensor (a *plane*), the axes that instead select separate
planes, sizes, padding (``extents``), optional explicit byte strides, folds (axes merged into
one dimension of the tensor a backend sees) and a packing factor.  From it anyone computes the
byte offset of any element, the per-layer view a kernel expects, and the contiguous byte
regions holding a set of blocks, without importing the backend that chose it.
"""
from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Iterable, Mapping

import attrs
import numpy as np

from .coerce import as_int, checked, int_array
from .dtypes import check_dtype, itemsize, numpy_dtype
from .errors import KVABIError, require
from .frozen import FrozenDict
from .layout_json import layout_from_json
from .planes import check_planes
from .presets import build_preset
from .version import WIRE_VERSION

AXES = ("L", "B", "KV", "N", "H", "D")
PLANE_AXES = ("L", "KV")
#: The most pieces :meth:`Layout.block_regions` enumerates for one call (before merging).
MAX_BLOCK_REGIONS = 2**24
_ARG = {"L": "layer", "B": "block", "KV": "kv", "N": "token", "H": "head", "D": "dim"}


def _axis_list(field):
    """Converter: a list or tuple of axis names (a bare string is not one)."""
    def convert(x):
        if isinstance(x, (str, bytes)) or not isinstance(x, (list, tuple)) or \
                not all(isinstance(a, str) for a in x):
            raise KVABIError(f"{field}: must be a list of axis names, got {x!r:.80}")
        return tuple(x)

    return convert


def _axis_map(field):
    """Converter: None, or a mapping axis -> value sorted in AXES order (values are
    checked in validation, where the axis is known)."""
    def convert(x):
        if x is None:
            return None
        if not isinstance(x, Mapping):
            raise KVABIError(f"{field}: must be an object of axis -> integer, got {x!r:.80}")
        return FrozenDict(sorted(x.items(), key=lambda kv: AXES.index(kv[0])
                                 if kv[0] in AXES else 99))

    return convert


def _folds(x):
    if isinstance(x, (str, bytes)) or not isinstance(x, (list, tuple)):
        raise KVABIError(f"folds: must be a list of lists of axis names, got {x!r:.80}")
    return tuple(_axis_list(f"folds[{i}]")(f) for i, f in enumerate(x))


def _int64(v: int, field: str, what: str) -> int:
    """``v`` (exact Python int arithmetic) if it fits int64, else KVABIError naming
    ``field`` and what ``v`` is."""
    try:
        return checked(v, field)
    except KVABIError:
        raise KVABIError(f"{field}: {what} ({v} bytes) does not fit in int64") from None


@attrs.frozen(eq=True, hash=False)
class Layout:
    """An immutable, validated physical layout.  Build with :meth:`preset` or directly.

    Every size, stride, offset and byte count a layout can produce fits in int64: a
    layout whose planes (or all planes together) would not is refused when built.
    """

    order: tuple[str, ...] = attrs.field(converter=_axis_list("order"))
    sizes: Mapping[str, int] = attrs.field(converter=_axis_map("sizes"))
    dtype: str = attrs.field()
    planes: tuple[str, ...] = attrs.field(default=(), converter=_axis_list("planes"))
    extents: Mapping[str, int] | None = attrs.field(default=None, converter=_axis_map("extents"))
    strides: Mapping[str, int] | None = attrs.field(default=None, converter=_axis_map("strides"))
    plane_bytes: int | None = attrs.field(default=None)
    folds: tuple[tuple[str, ...], ...] = attrs.field(default=(), converter=_folds)
    packing: int | None = attrs.field(default=None)
    name: str | None = attrs.field(default=None)
    # Derived once at construction (exact, checked): byte stride per axis, the natural
    # span of a plane, bytes per plane and in all planes, number of planes.
    _stride: dict = attrs.field(init=False, eq=False, repr=False)
    _natural: int = attrs.field(init=False, eq=False, repr=False)
    _plane_nbytes: int = attrs.field(init=False, eq=False, repr=False)
    _num_planes: int = attrs.field(init=False, eq=False, repr=False)
    # The tensor a backend sees (shape, element strides), asked for on every plane check.
    _shape: tuple = attrs.field(init=False, eq=False, repr=False)
    _elem_strides: tuple = attrs.field(init=False, eq=False, repr=False)

    # -- validation --------------------------------------------------------------------
    def __attrs_post_init__(self):
        require(self.name is None or isinstance(self.name, str), "name",
                "must be a string or null", self.name)
        check_dtype(self.dtype)
        isz = itemsize(self.dtype)
        seen = list(self.order) + list(self.planes)
        for a in seen:
            require(a in AXES, "order", f"unknown axis {a!r}; axes are {AXES}")
        require(len(set(seen)) == len(seen), "order", "an axis appears twice in order+planes",
                seen)
        for a in ("B", "N", "H", "D"):
            require(a in self.order, "order", f"axis {a} must be in the memory order",
                    self.order)
        for a in self.planes:
            require(a in PLANE_AXES, "planes", f"only {PLANE_AXES} may be plane axes", a)
        extra = set(self.sizes) - set(seen)
        require(not extra, "sizes", "names axes not in the layout", sorted(map(str, extra)))
        sizes = FrozenDict((a, as_int(self.sizes.get(a), f"sizes.{a}", lo=1))
                           for a in self.sizes)
        for a in seen:
            require(a in sizes, f"sizes.{a}", "must be a positive int (missing)")
        object.__setattr__(self, "sizes", sizes)
        if "KV" in seen:
            require(sizes["KV"] == 2, "sizes.KV", "must be 2 (key, value)", sizes["KV"])
        if self.extents is not None:
            ext = {}
            for a, v in self.extents.items():
                require(a in self.order, f"extents.{a}", "only memory-order axes have extents")
                ext[a] = as_int(v, f"extents.{a}", lo=sizes[a])
            object.__setattr__(self, "extents", FrozenDict(ext) if ext else None)
        # Strides and spans in exact Python ints, each checked against int64.
        if self.strides is None:
            stride, s = {}, isz
            for a in reversed(self.order):
                stride[a] = s
                s = _int64(s * self.extent(a), "sizes", f"the bytes spanned by axes up "
                           f"to {a}")
        else:
            require(set(self.strides) == set(self.order), "strides",
                    f"must give a byte stride for each of {self.order}",
                    sorted(map(str, self.strides)))
            stride = {a: as_int(self.strides[a], f"strides.{a}", lo=1) for a in self.order}
            for a, s in stride.items():
                require(s % isz == 0, f"strides.{a}",
                        f"must be a positive multiple of itemsize {isz}", s)
            # Memory order is `order`: each axis must step over the whole of the next one.
            for outer, inner in zip(self.order, self.order[1:]):
                need = self.extent(inner) * stride[inner]
                require(stride[outer] >= need, f"strides.{outer}",
                        f"overlaps axis {inner} (needs >= {need})", stride[outer])
            stride = FrozenDict(stride)
            object.__setattr__(self, "strides", stride)
        object.__setattr__(self, "_stride", FrozenDict(stride))
        natural = _int64(sum((self.extent(a) - 1) * stride[a] for a in self.order) + isz,
                         "strides" if self.strides is not None else "sizes",
                         "the bytes one plane spans")
        object.__setattr__(self, "_natural", natural)
        if self.plane_bytes is None:
            nbytes = natural
        else:
            nbytes = as_int(self.plane_bytes, "plane_bytes", lo=1)
            require(nbytes >= natural, "plane_bytes",
                    f"must be an int >= {natural} (the bytes the strides reach)", nbytes)
            object.__setattr__(self, "plane_bytes", nbytes)
        object.__setattr__(self, "_plane_nbytes", nbytes)
        nplanes = math.prod(sizes[a] for a in self.planes)
        object.__setattr__(self, "_num_planes", nplanes)
        _int64(nplanes * nbytes, "sizes", f"the bytes of all {nplanes} planes")
        self._check_folds()
        if self.packing is not None:
            object.__setattr__(self, "packing", as_int(self.packing, "packing", lo=1))
            hdim = self._view_groups()[self._h_group()]
            e = math.prod(self.extent(a) for a in hdim)
            require(e % self.packing == 0, "packing",
                    f"must divide the {'*'.join(hdim)} dimension ({e}); heads are never "
                    f"padded silently", self.packing)
        object.__setattr__(self, "_shape", self._plane_shape())
        object.__setattr__(self, "_elem_strides", self._plane_strides())

    def _check_folds(self):
        used = set()
        for f in self.folds:
            require(len(f) >= 2, "folds", "a fold merges at least two axes", f)
            for a in f:
                require(a in self.order and a not in used, "folds",
                        f"axis {a!r} is not in order or folded twice", f)
                used.add(a)
            i = self.order.index(f[0])
            require(tuple(self.order[i:i + len(f)]) == f, "folds",
                    "folded axes must be consecutive in the memory order", f)
            for outer, inner in zip(f, f[1:]):
                require(self.stride(outer) == self.extent(inner) * self.stride(inner), "folds",
                        f"{outer} and {inner} are not contiguous, cannot fold", f)

    # -- sizes and strides ---------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    def size(self, axis: str) -> int:
        """Logical size of ``axis`` (1 when the layout lacks it)."""
        return self.sizes.get(axis, 1)

    def extent(self, axis: str) -> int:
        """Physical (padded) size of a memory-order axis."""
        return (self.extents or {}).get(axis, self.sizes[axis])

    def stride(self, axis: str) -> int:
        """Byte stride of a memory-order axis."""
        s = self._stride.get(axis)
        if s is None:
            raise KVABIError(f"axis: {axis!r} is not in the memory order {self.order}")
        return s

    def _span(self) -> int:
        """Bytes from a plane's first byte to the end of its last element."""
        return self._natural

    @property
    def num_layers(self) -> int:
        return self.size("L")

    @property
    def num_blocks(self) -> int:
        return self.sizes["B"]

    @property
    def has_kv(self) -> bool:
        """False for MLA layouts (one latent plane, no key/value axis)."""
        return "KV" in self.sizes

    @property
    def num_planes(self) -> int:
        return self._num_planes

    @property
    def plane_nbytes(self) -> int:
        """Bytes of each plane tensor."""
        return self._plane_nbytes

    @property
    def total_nbytes(self) -> int:
        """Bytes of all planes together (fits int64: checked at construction)."""
        return self._num_planes * self._plane_nbytes

    @property
    def is_c_contiguous(self) -> bool:
        """Each plane is exactly a C-contiguous array of :attr:`plane_shape`."""
        n = math.prod(self.plane_shape) * self.itemsize
        return self.plane_nbytes == n and self.plane_strides == _c_strides(self.plane_shape)

    # -- the view a backend sees ---------------------------------------------------------
    def _view_groups(self) -> list[tuple[str, ...]]:
        groups, i = [], 0
        starts = {f[0]: f for f in self.folds}
        while i < len(self.order):
            g = starts.get(self.order[i], (self.order[i],))
            groups.append(g)
            i += len(g)
        return groups

    def _h_group(self) -> int:
        return next(i for i, g in enumerate(self._view_groups()) if "H" in g)

    @property
    def view_axes(self) -> tuple[tuple[str, ...], ...]:
        """Logical axes of each dimension of a plane tensor; packing adds a ``("p",)`` dim."""
        out = []
        for i, g in enumerate(self._view_groups()):
            out.append(g)
            if self.packing is not None and i == self._h_group():
                out.append(("p",))
        return tuple(out)

    @property
    def plane_shape(self) -> tuple[int, ...]:
        """Shape of each plane tensor as the backend sees it (extents, folds, packing)."""
        return self._shape

    @property
    def plane_strides(self) -> tuple[int, ...]:
        """Element strides of each plane tensor's dimensions."""
        return self._elem_strides

    def _plane_shape(self) -> tuple[int, ...]:
        shape = []
        for i, g in enumerate(self._view_groups()):
            e = math.prod(self.extent(a) for a in g)
            if self.packing is not None and i == self._h_group():
                shape += [e // self.packing, self.packing]
            else:
                shape.append(e)
        return tuple(shape)

    def _plane_strides(self) -> tuple[int, ...]:
        out = []
        for i, g in enumerate(self._view_groups()):
            s = self.stride(g[-1]) // self.itemsize
            if self.packing is not None and i == self._h_group():
                out += [s * self.packing, s]
            else:
                out.append(s)
        return tuple(out)

    # -- addressing ----------------------------------------------------------------------
    def plane_index(self, layer=0, kv=0):
        """Index of the plane holding (layer, kv); vectorized over integer arrays."""
        vals = self._indices({"L": layer, "KV": kv})
        p = self._plane_of(vals["L"], vals["KV"])
        return p if np.ndim(p) else int(p)

    def _plane_of(self, layer, kv):
        idx = {"L": layer, "KV": kv}
        p = np.int64(0)
        for a in self.planes:
            p = p * self.sizes[a] + idx[a]
        return p

    def _indices(self, args: dict) -> dict:
        """Strict int64 arrays of logical indices, each inside its axis (KVABIError naming
        the argument otherwise: no float, no bool, no wrap)."""
        vals = {}
        for a, v in args.items():
            v = int_array(v, _ARG[a], ndim=None)
            hi = self.size(a)
            if v.size and (v.min() < 0 or v.max() >= hi):
                bad = v[(v < 0) | (v >= hi)].ravel()[0]
                raise KVABIError(f"{_ARG[a]}: {int(bad)} out of range [0, {hi})")
            vals[a] = v
        return vals

    def byte_offset(self, layer=0, block=0, kv=0, token=0, head=0, dim=0):
        """(plane, byte offset within the plane) of one logical element.

        Arguments broadcast as integer arrays (lists, numpy, torch); floats, bools and
        out-of-range indices raise KVABIError.  Offsets are int64 and always inside the
        plane (indices in range and a checked layout cannot reach past its span).
        """
        vals = self._indices({"L": layer, "B": block, "KV": kv, "N": token, "H": head,
                              "D": dim})
        off = sum(vals[a] * self._stride[a] for a in self.order)
        plane = self._plane_of(vals["L"], vals["KV"])
        if np.ndim(off) == 0 and np.ndim(plane) == 0:
            return int(plane), int(off)
        plane, off = np.broadcast_arrays(plane, off)
        return plane, off

    # -- arrays --------------------------------------------------------------------------
    def allocate_numpy(self, fill=0, *, bytewise: bool = False) -> list[np.ndarray]:
        """Planes as numpy arrays shaped :attr:`plane_shape` (strided over a padded buffer
        where the layout pads).  Every element of the buffer, padding included, holds the
        value ``fill`` (e.g. NaN); with ``bytewise`` every byte holds ``fill``, a byte
        value 0..255."""
        dt = numpy_dtype(self.dtype)
        n = -(-self.plane_nbytes // self.itemsize)
        if bytewise:
            fill = as_int(fill, "fill", lo=0, hi=255)
        elif not isinstance(fill, (int, float, np.integer, np.floating)) or \
                isinstance(fill, (bool, np.bool_)):
            raise KVABIError(f"fill: must be a number, got {fill!r:.60}")
        strides = [s * self.itemsize for s in self.plane_strides]
        planes = []
        for _ in range(self.num_planes):
            if bytewise:
                buf = np.full(n * self.itemsize, fill, dtype=np.uint8).view(dt)
            else:
                try:
                    buf = np.full(n, fill, dtype=dt)
                except (OverflowError, ValueError):
                    raise KVABIError(f"fill: {fill!r} is not a {self.dtype} value") from None
            planes.append(_as_strided(buf, self.plane_shape, strides))
        return planes

    def layer_view(self, planes, layer: int) -> tuple:
        """Per-layer tensors: ``(t,)`` when K and V share a plane (or MLA), ``(k, v)`` when
        KV is a plane axis.  The L dimension, if in a plane, is indexed away (no copy for
        numpy and torch; jax slices).  ``planes`` (a KVCache or a list) is checked against
        the layout first: count, shape, dtype, strides and memory (a KVCache's own
        :meth:`~kvabi.KVCache.layer_view` caches the view instead)."""
        check_planes(self, planes)
        return self._layer_view(planes, layer)

    def _layer_view(self, planes, layer) -> tuple:
        """:meth:`layer_view` of planes already checked against this layout."""
        from .step_checks import check_layer

        layer = check_layer(layer, self)
        kvs = range(2) if "KV" in self.planes else range(1)
        out = []
        for kv in kvs:
            t = planes[int(self._plane_of(layer, kv))]
            if "L" in self.order:
                dim = self.view_axes.index(("L",)) if ("L",) in self.view_axes else None
                if dim is None:
                    raise KVABIError("layer: L is folded with another axis; no per-layer view")
                t = t[(slice(None),) * dim + (layer,)]
            out.append(t)
        return tuple(out)

    def kv_view(self, planes, layer: int, kv: int):
        """Strided view [B, N, H, D] (logical sizes, no copy) of the keys (kv=0) or values
        (kv=1) of one layer; numpy arrays and torch tensors; writes go through.  ``planes``
        is checked first (see :meth:`layer_view`): a view never reaches past the memory."""
        check_planes(self, planes)
        return self._kv_view(planes, layer, kv)

    def _kv_view(self, planes, layer, kv):
        """:meth:`kv_view` of planes already checked against this layout."""
        plane_no, base = self.byte_offset(layer=layer, kv=kv)
        plane = planes[plane_no]
        shape = tuple(self.size(a) for a in ("B", "N", "H", "D"))
        strides = tuple(self.stride(a) for a in ("B", "N", "H", "D"))
        if isinstance(plane, np.ndarray):
            flat = _as_strided(
                plane, (self.plane_nbytes // self.itemsize,), (self.itemsize,))
            return _as_strided(flat[base // self.itemsize:], shape, strides)
        if hasattr(plane, "as_strided"):  # torch
            return plane.as_strided(shape, tuple(s // self.itemsize for s in strides),
                                    plane.storage_offset() + base // self.itemsize)
        raise KVABIError(f"planes: kv_view needs numpy or torch arrays, got {type(plane)}")

    # -- block regions -------------------------------------------------------------------
    @property
    def is_block_contiguous(self) -> bool:
        """Each block (all layers of the plane) is one byte range of each plane."""
        return self.order[0] == "B"

    def block_regions(self, block_ids, layers: Iterable[int] | None = None):
        """Fewest contiguous byte regions ``(plane, offset, nbytes)`` holding the blocks.

        Regions of adjacent blocks merge (padding between them included); sorted by plane
        and offset.  Vectorized over blocks and the axes outside B; time and memory are
        proportional to the regions enumerated (blocks asked times the planes and outer
        axes), never to ``num_blocks``.  Every region lies inside its plane.
        """
        blocks = np.unique(int_array(block_ids, "block_ids", ndim=None).ravel())
        if blocks.size and (blocks[0] < 0 or blocks[-1] >= self.num_blocks):
            bad = blocks[0] if blocks[0] < 0 else blocks[-1]
            raise KVABIError(f"block_ids: {int(bad)} out of range [0, {self.num_blocks})")
        if layers is None:
            lay = None
        else:
            if isinstance(layers, (Iterator, range, set, frozenset)):
                layers = sorted(layers) if isinstance(layers, (set, frozenset)) else \
                    list(layers)
            lay = np.unique(int_array(layers, "layers", ndim=None).ravel())
            if lay.size and (lay[0] < 0 or lay[-1] >= self.num_layers):
                bad = lay[0] if lay[0] < 0 else lay[-1]
                raise KVABIError(f"layers: {int(bad)} out of range [0, {self.num_layers})")
            if not lay.size:
                return []
        if not blocks.size:
            return []
        # Enumerate plane axes and memory axes down to the innermost one we select on
        # (B, or L when only some layers are wanted and L lies inside B).
        cut = self.order.index("B")
        if lay is not None and "L" in self.order and len(lay) < self.num_layers:
            cut = max(cut, self.order.index("L"))
        outer = list(self.order[:cut + 1])
        inner = self.order[cut + 1:]
        span = sum((self.extent(a) - 1) * self.stride(a) for a in inner) + self.itemsize
        # Regions merge across at most the padding between two consecutive cut-axis entries.
        gap = self.stride(self.order[cut]) - span

        def whole(a):  # every index of axis a is asked for
            if a == "B":
                return blocks.size == self.num_blocks
            return a != "L" or lay is None or lay.size == self.num_layers

        # Fold the innermost enumerated axes into the region while the merge below would
        # join all their entries anyway (every index asked, consecutive entries at most
        # `gap` apart): the work then follows the regions returned, not an axis's size.
        while outer and whole(outer[-1]) and self.stride(outer[-1]) - span <= gap:
            a = outer.pop()
            span += (self.size(a) - 1) * self.stride(a)
        dims = list(self.planes) + outer

        def values(a):  # only the axes enumerated are materialized
            if a == "B":
                return blocks
            if a == "L" and lay is not None:
                return lay
            return np.arange(self.size(a), dtype=np.int64)

        n = math.prod(blocks.size if a == "B" else lay.size if a == "L" and lay is not None
                      else self.size(a) for a in dims)
        if n > MAX_BLOCK_REGIONS:
            raise KVABIError(f"block_ids: {len(blocks)} blocks of this layout lie in {n} "
                             f"separate pieces (blocks asked times the planes and the axes "
                             f"outside B), more than MAX_BLOCK_REGIONS = {MAX_BLOCK_REGIONS}")
        if dims:
            grids = np.meshgrid(*[values(a) for a in dims], indexing="ij")
            g = {a: x.ravel() for a, x in zip(dims, grids)}
        else:
            g = {}
        plane = np.broadcast_to(np.asarray(self._plane_of(g.get("L", 0), g.get("KV", 0)),
                                           dtype=np.int64), (n,))
        off = sum((g[a] * self.stride(a) for a in outer), np.zeros(n, np.int64))
        order = np.lexsort((off, plane))
        plane, off = plane[order], off[order]
        end = off + span
        # A new region starts where the plane changes or the gap is more than block padding.
        new = np.ones(len(off), bool)
        new[1:] = (plane[1:] != plane[:-1]) | (off[1:] - end[:-1] > gap)
        starts = np.nonzero(new)[0]
        last = np.r_[starts[1:], len(off)] - 1
        return [(int(p), int(o), int(e - o)) for p, o, e in
                zip(plane[starts], off[starts], end[last])]

    # -- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "kvabi_abi": list(WIRE_VERSION),
            "name": self.name,
            "dtype": self.dtype,
            "order": list(self.order),
            "planes": list(self.planes),
            "sizes": dict(self.sizes),
            "extents": dict(self.extents) if self.extents else {},
            "strides": dict(self.strides) if self.strides else None,
            "plane_bytes": self.plane_bytes,
            "folds": [list(f) for f in self.folds],
            "packing": self.packing,
        }

    def to_json(self) -> str:
        """The versioned JSON descriptor (``specs/layout.schema.json``)."""
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text, *, max_bytes: int | None = None) -> "Layout":
        """Parse an untrusted descriptor.  Refuses another ABI major, accepts a newer minor
        (ignoring unknown fields); any malformed field raises KVABIError naming it.
        ``max_bytes`` bounds the bytes of the whole descriptor (all planes together, e.g.
        the receiver's buffers); the text goes through :func:`kvabi.safe_json.loads`."""
        return layout_from_json(cls, text, max_bytes=max_bytes)

    # -- presets -------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, spec, num_blocks: int, num_layers: int = 1) -> "Layout":
        """A named layout of the anchors for ``spec`` (see :data:`kvabi.presets.PRESETS`)."""
        return build_preset(cls, name, spec, num_blocks, num_layers)


def _c_strides(shape) -> tuple[int, ...]:
    out, s = [], 1
    for e in reversed(shape):
        out.append(s)
        s *= e
    return tuple(reversed(out))


def _as_strided(x: np.ndarray, shape, strides) -> np.ndarray:
    """``as_strided`` that also works for ml_dtypes float8_e5m2, whose array-interface
    typestr numpy cannot parse: stride an unsigned-int view and view it back."""
    raw = x.view(np.dtype(f"u{x.dtype.itemsize}"))
    return np.lib.stride_tricks.as_strided(raw, shape, strides).view(x.dtype)


def check_layout(value, field: str = "layout") -> "Layout":
    """``value`` when it is a :class:`Layout`; else KVABIError naming ``field`` (with a
    hint for a preset name, the usual mistake)."""
    if not isinstance(value, Layout):
        hint = " (a preset name? Layout.preset(name, spec, num_blocks) builds one)" \
            if isinstance(value, str) else ""
        raise KVABIError(f"{field}: must be a kvabi.Layout, got {type(value).__name__}{hint}")
    return value
