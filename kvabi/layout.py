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
from typing import Iterable, Mapping

import attrs
import numpy as np

from .abi import ABI_VERSION
from .dtypes import check_dtype, itemsize, numpy_dtype, tpu_packing
from .errors import KVABIError, require

AXES = ("L", "B", "KV", "N", "H", "D")
PLANE_AXES = ("L", "KV")
_ARG = {"L": "layer", "B": "block", "KV": "kv", "N": "token", "H": "head", "D": "dim"}


def _frozen_map(x) -> Mapping[str, int] | None:
    if x is None:
        return None
    return dict(sorted(dict(x).items(), key=lambda kv: AXES.index(kv[0])
                       if kv[0] in AXES else 99))


@attrs.frozen(eq=True, hash=False)
class Layout:
    """An immutable, validated physical layout.  Build with :meth:`preset` or directly."""

    order: tuple[str, ...] = attrs.field(converter=tuple)
    sizes: Mapping[str, int] = attrs.field(converter=_frozen_map)
    dtype: str = attrs.field()
    planes: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    extents: Mapping[str, int] | None = attrs.field(default=None, converter=_frozen_map)
    strides: Mapping[str, int] | None = attrs.field(default=None, converter=_frozen_map)
    plane_bytes: int | None = attrs.field(default=None)
    folds: tuple[tuple[str, ...], ...] = attrs.field(
        default=(), converter=lambda f: tuple(tuple(x) for x in f))
    packing: int | None = attrs.field(default=None)
    name: str | None = attrs.field(default=None)

    # -- validation --------------------------------------------------------------------
    def __attrs_post_init__(self):
        check_dtype(self.dtype)
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
        for a in seen:
            v = self.sizes.get(a)
            require(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"sizes.{a}",
                    "must be a positive int", v)
        extra = set(self.sizes) - set(seen)
        require(not extra, "sizes", "names axes not in the layout", sorted(extra))
        if "KV" in seen:
            require(self.sizes["KV"] == 2, "sizes.KV", "must be 2 (key, value)",
                    self.sizes["KV"])
        ext = self.extents or {}
        for a, v in ext.items():
            require(a in self.order, f"extents.{a}", "only memory-order axes have extents")
            require(isinstance(v, int) and v >= self.sizes[a], f"extents.{a}",
                    f"must be an int >= size {self.sizes[a]}", v)
        if self.strides is not None:
            require(set(self.strides) == set(self.order), "strides",
                    f"must give a byte stride for each of {self.order}", sorted(self.strides))
            for a, s in self.strides.items():
                require(isinstance(s, int) and s > 0 and s % self.itemsize == 0,
                        f"strides.{a}", f"must be a positive multiple of itemsize "
                        f"{self.itemsize}", s)
            # Memory order is `order`: each axis must step over the whole of the next one.
            for outer, inner in zip(self.order, self.order[1:]):
                need = self.extent(inner) * self.strides[inner]
                require(self.strides[outer] >= need, f"strides.{outer}",
                        f"overlaps axis {inner} (needs >= {need})", self.strides[outer])
            require(self.strides[self.order[-1]] >= self.itemsize, f"strides.{self.order[-1]}",
                    "smaller than one element", self.strides[self.order[-1]])
        natural = self._span()
        if self.plane_bytes is not None:
            require(isinstance(self.plane_bytes, int) and self.plane_bytes >= natural,
                    "plane_bytes", f"must be an int >= {natural} (the bytes the strides reach)",
                    self.plane_bytes)
        self._check_folds()
        require(self.packing is None or (isinstance(self.packing, int) and self.packing >= 1),
                "packing", "must be a positive int or null", self.packing)
        if self.packing is not None:
            hdim = self._view_groups()[self._h_group()]
            e = int(np.prod([self.extent(a) for a in hdim]))
            require(e % self.packing == 0, "packing",
                    f"must divide the {'*'.join(hdim)} dimension ({e}); heads are never "
                    f"padded silently", self.packing)

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
        if self.strides is not None:
            return self.strides[axis]
        s = self.itemsize
        for a in reversed(self.order):
            if a == axis:
                return s
            s *= self.extent(a)
        raise KVABIError(f"axis: {axis!r} is not in the memory order {self.order}")

    def _span(self) -> int:
        return sum((self.extent(a) - 1) * self.stride(a) for a in self.order) + self.itemsize

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
        return int(np.prod([self.sizes[a] for a in self.planes], dtype=np.int64))

    @property
    def plane_nbytes(self) -> int:
        """Bytes of each plane tensor."""
        return self.plane_bytes if self.plane_bytes is not None else self._span()

    @property
    def total_nbytes(self) -> int:
        return self.num_planes * self.plane_nbytes

    @property
    def is_c_contiguous(self) -> bool:
        """Each plane is exactly a C-contiguous array of :attr:`plane_shape`."""
        n = int(np.prod(self.plane_shape)) * self.itemsize
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
        shape = []
        for i, g in enumerate(self._view_groups()):
            e = int(np.prod([self.extent(a) for a in g]))
            if self.packing is not None and i == self._h_group():
                shape += [e // self.packing, self.packing]
            else:
                shape.append(e)
        return tuple(shape)

    @property
    def plane_strides(self) -> tuple[int, ...]:
        """Element strides of each plane tensor's dimensions."""
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
        """Index of the plane holding (layer, kv); vectorized over numpy arrays."""
        idx = {"L": layer, "KV": kv}
        p = 0
        for a in self.planes:
            p = p * self.sizes[a] + np.asarray(idx[a])
        return p if np.ndim(p) else int(p)

    def byte_offset(self, layer=0, block=0, kv=0, token=0, head=0, dim=0):
        """(plane, byte offset within the plane) of one logical element.

        Arguments broadcast as numpy integer arrays; out-of-range indices raise KVABIError.
        """
        args = {"L": layer, "B": block, "KV": kv, "N": token, "H": head, "D": dim}
        vals = {}
        for a, v in args.items():
            v = np.asarray(v, dtype=np.int64)
            hi = self.size(a)
            if v.size and (v.min() < 0 or v.max() >= hi):
                bad = v[(v < 0) | (v >= hi)].ravel()[0]
                raise KVABIError(f"{_ARG[a]}: index {int(bad)} out of range [0, {hi})")
            vals[a] = v
        off = sum(vals[a] * self.stride(a) for a in self.order)
        plane = self.plane_index(vals["L"], vals["KV"])
        if np.ndim(off) == 0 and np.ndim(plane) == 0:
            return int(plane), int(off)
        plane, off = np.broadcast_arrays(plane, off)
        return plane, off

    # -- arrays --------------------------------------------------------------------------
    def allocate_numpy(self, fill=0) -> list[np.ndarray]:
        """Planes as numpy arrays shaped :attr:`plane_shape` (strided over a padded buffer
        where the layout pads); every byte, padding included, holds ``fill``."""
        dt = numpy_dtype(self.dtype)
        n = -(-self.plane_nbytes // self.itemsize)
        strides = [s * self.itemsize for s in self.plane_strides]
        planes = []
        for _ in range(self.num_planes):
            buf = np.full(n, fill, dtype=dt)
            planes.append(_as_strided(buf, self.plane_shape, strides))
        return planes

    def layer_view(self, planes, layer: int) -> tuple:
        """Per-layer tensors: ``(t,)`` when K and V share a plane (or MLA), ``(k, v)`` when
        KV is a plane axis.  The L dimension, if in a plane, is indexed away (no copy for
        numpy and torch; jax slices)."""
        self._check_planes(planes)
        require(0 <= layer < self.num_layers, "layer", f"out of range [0, {self.num_layers})",
                layer)
        kvs = range(2) if "KV" in self.planes else range(1)
        out = []
        for kv in kvs:
            t = planes[self.plane_index(layer, kv)]
            if "L" in self.order:
                dim = self.view_axes.index(("L",)) if ("L",) in self.view_axes else None
                if dim is None:
                    raise KVABIError("layer: L is folded with another axis; no per-layer view")
                t = t[(slice(None),) * dim + (layer,)]
            out.append(t)
        return tuple(out)

    def kv_view(self, planes, layer: int, kv: int):
        """Strided view [B, N, H, D] (logical sizes, no copy) of the keys (kv=0) or values
        (kv=1) of one layer; numpy arrays and torch tensors; writes go through."""
        self._check_planes(planes)
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

    def _check_planes(self, planes):
        require(len(planes) == self.num_planes, "planes",
                f"layout has {self.num_planes} planes", len(planes))
        for i, p in enumerate(planes):
            require(tuple(p.shape) == self.plane_shape, f"planes[{i}].shape",
                    f"must be {self.plane_shape}", tuple(p.shape))

    # -- block regions -------------------------------------------------------------------
    @property
    def is_block_contiguous(self) -> bool:
        """Each block (all layers of the plane) is one byte range of each plane."""
        return self.order[0] == "B"

    def block_regions(self, block_ids, layers: Iterable[int] | None = None):
        """Fewest contiguous byte regions ``(plane, offset, nbytes)`` holding the blocks.

        Regions of adjacent blocks merge (padding between them included); sorted by plane
        and offset.  Vectorized over blocks and the axes outside B.
        """
        blocks = np.unique(np.asarray(block_ids, dtype=np.int64).ravel())
        if blocks.size and (blocks[0] < 0 or blocks[-1] >= self.num_blocks):
            raise KVABIError(f"block_ids: out of range [0, {self.num_blocks})")
        lay = np.arange(self.num_layers) if layers is None else np.unique(
            np.asarray(list(layers), dtype=np.int64))
        if lay.size and (lay[0] < 0 or lay[-1] >= self.num_layers):
            raise KVABIError(f"layers: out of range [0, {self.num_layers})")
        if not blocks.size or not lay.size:
            return []
        # Enumerate plane axes and memory axes down to the innermost one we select on
        # (B, or L when only some layers are wanted and L lies inside B).
        cut = self.order.index("B")
        if layers is not None and "L" in self.order and len(lay) < self.num_layers:
            cut = max(cut, self.order.index("L"))
        outer = self.order[:cut + 1]
        inner = self.order[cut + 1:]
        span = sum((self.extent(a) - 1) * self.stride(a) for a in inner) + self.itemsize
        step = self.stride(self.order[cut])
        ranges = {"L": lay, "B": blocks}
        dims = list(self.planes) + list(outer)
        grids = np.meshgrid(*[ranges.get(a, np.arange(self.size(a))) for a in dims],
                            indexing="ij")
        g = {a: x.ravel() for a, x in zip(dims, grids)}
        n = g["B"].size
        plane = np.broadcast_to(np.asarray(self.plane_index(g.get("L", 0), g.get("KV", 0)),
                                           dtype=np.int64), (n,))
        off = sum((g[a] * self.stride(a) for a in outer), np.zeros(n, np.int64))
        order = np.lexsort((off, plane))
        plane, off = plane[order], off[order]
        end = off + span
        # A new region starts where the plane changes or the gap is more than block padding.
        new = np.ones(len(off), bool)
        new[1:] = (plane[1:] != plane[:-1]) | (off[1:] - end[:-1] > step - span)
        starts = np.nonzero(new)[0]
        last = np.r_[starts[1:], len(off)] - 1
        return [(int(p), int(o), int(e - o)) for p, o, e in
                zip(plane[starts], off[starts], end[last])]

    # -- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "kvabi_abi": list(ABI_VERSION),
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
        ``max_bytes`` additionally bounds each plane (e.g. the receiver's buffer size)."""
        from .layout_json import layout_from_json

        return layout_from_json(cls, text, max_bytes=max_bytes)

    # -- presets -------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, spec, num_blocks: int, num_layers: int = 1) -> "Layout":
        """A named layout of the anchors for ``spec`` (see :data:`kvabi.presets.PRESETS`)."""
        from .presets import make_preset

        return make_preset(name, spec, num_blocks, num_layers)


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
