"""The KV cache handle a step passes around (ABI 1.1): a layout, its planes, and the
per-layer views computed once.

:class:`KVCache` is where cache memory enters kvabi, so it is where that memory is checked
against the layout, once: the number of planes, each plane's shape, dtype and strides, and
that the memory under each plane reaches the furthest byte the layout addresses (a plane of
the right shape over too small a buffer is refused, never written past).  Behind the check,
a view costs a dictionary lookup.

A KVCache *is* a tuple of its planes, so code written for ABI 1.0 (which passed a plain
list of planes) keeps working when handed one.
"""
from __future__ import annotations

import numpy as np

from .errors import KVABIError
from .tensors import dtype_name, framework


class KVCache(tuple):
    """An immutable tuple of planes bound to a :class:`~kvabi.Layout`.

    Build with :meth:`wrap` (memory an engine owns: numpy, torch or jax arrays) or get one
    from ``backend.allocate(layout)``.  numpy and torch planes are written in place; jax
    arrays are immutable, so a jax write returns a new handle (:meth:`replace`).
    """

    # (a tuple subclass cannot have __slots__: attributes live in the instance dict)

    def __new__(cls, layout, planes, _checked: bool = False):
        if not _checked:
            fw = check_planes(layout, planes)
        else:
            fw = framework(planes[0]) if planes else "numpy"
        self = super().__new__(cls, planes)
        self.layout = layout
        self.framework = fw
        self._views = {}
        return self

    @classmethod
    def wrap(cls, layout, planes) -> "KVCache":
        """A handle over ``planes`` after checking them against ``layout`` (KVABIError
        naming the plane and what is wrong).  A KVCache of the same layout is returned
        as it is."""
        from .layout import Layout

        if not isinstance(layout, Layout):
            raise KVABIError(f"layout: must be a kvabi.Layout, got {type(layout).__name__}")
        if isinstance(planes, KVCache) and (planes.layout is layout or planes.layout == layout):
            return planes
        return cls(layout, tuple(planes) if isinstance(planes, (list, tuple)) else planes)

    @classmethod
    def allocate(cls, layout, framework: str = "numpy", *, device=None,
                 fill: int = 0) -> "KVCache":
        """Planes for ``layout`` whose every byte (padding included) is ``fill``, in
        ``framework`` ("numpy", "torch", "jax"); strided over a buffer of
        ``layout.plane_nbytes`` so byte offsets match the layout (jax: dense layouts only)."""
        from .dtypes import numpy_dtype

        n = -(-layout.plane_nbytes // layout.itemsize)
        if framework == "numpy":
            return cls(layout, tuple(layout.allocate_numpy(fill)), _checked=True)
        if framework == "torch":
            import torch

            from .tensors import torch_dtype

            planes = []
            for _ in range(layout.num_planes):
                buf = torch.full((n,), fill, dtype=torch_dtype(layout.dtype), device=device) \
                    if fill else torch.zeros(n, dtype=torch_dtype(layout.dtype), device=device)
                planes.append(buf.as_strided(layout.plane_shape, layout.plane_strides))
            return cls(layout, tuple(planes), _checked=True)
        if framework == "jax":
            import jax.numpy as jnp

            if not layout.is_c_contiguous:
                raise KVABIError(f"layout: {layout.name or 'custom'} has padding bytes or "
                                 f"explicit strides; jax arrays are dense")
            dt = numpy_dtype(layout.dtype)
            return cls(layout, tuple(jnp.full(layout.plane_shape, fill, dt)
                                     for _ in range(layout.num_planes)), _checked=True)
        raise KVABIError(f"framework: must be numpy, torch or jax, got {framework!r}")

    @property
    def planes(self) -> tuple:
        return tuple(self)

    def replace(self, planes) -> "KVCache":
        """A handle of the same layout over new planes (after a jax write), checked."""
        return KVCache(self.layout, tuple(planes))

    def replace_planes(self, updates: dict) -> "KVCache":
        """A handle where plane ``i`` is ``updates[i]`` (shape and dtype checked; for jax
        writes that produce new arrays of the same planes)."""
        planes = list(self)
        for i, p in updates.items():
            _check_dense(self.layout, p, i, framework(p))
            planes[i] = p
        return KVCache(self.layout, tuple(planes), _checked=True)

    def layer_view(self, layer: int) -> tuple:
        """The layout's per-layer tensors (see :meth:`kvabi.Layout.layer_view`), cached."""
        key = ("layer", layer)
        v = self._views.get(key)
        if v is None:
            v = self._views[key] = self.layout.layer_view(self, layer)
        return v

    def kv_view(self, layer: int, kv: int):
        """Strided [B, N, H, D] view of the keys (kv=0) or values (kv=1) of ``layer``
        (numpy and torch planes; writes go through), cached."""
        key = (layer, kv)
        v = self._views.get(key)
        if v is None:
            if self.framework == "jax":
                raise KVABIError("cache: jax planes have no strided views; use layer_view")
            v = self._views[key] = self.layout.kv_view(self, layer, kv)
        return v

    def __repr__(self) -> str:
        return (f"KVCache({self.layout.name or 'custom'}, {len(self)} {self.framework} "
                f"planes of {self.layout.plane_shape} {self.layout.dtype})")

    # Identity semantics: planes are arrays, whose == is elementwise.
    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    __hash__ = object.__hash__

    def __reduce__(self):
        return (KVCache, (self.layout, tuple(self)))


def as_cache(cache, layout) -> KVCache:
    """The handle for ``cache`` (a KVCache, or an ABI 1.0 list of planes) and ``layout``:
    a lookup for a KVCache of that layout, a full check otherwise.  Every backend calls
    this before it touches cache memory."""
    if isinstance(cache, KVCache) and cache.layout is layout:
        return cache
    return KVCache.wrap(layout, cache)


def check_planes(layout, planes) -> str:
    """Check ``planes`` against ``layout``; returns their framework."""
    if not isinstance(planes, (list, tuple)):
        raise KVABIError(f"cache: must be a KVCache or a list of planes, got "
                         f"{type(planes).__name__}")
    if len(planes) != layout.num_planes:
        raise KVABIError(f"cache: layout has {layout.num_planes} planes, got {len(planes)}")
    fws = {framework(p) for p in planes}
    if None in fws:
        bad = next(i for i, p in enumerate(planes) if framework(p) is None)
        raise KVABIError(f"cache[{bad}]: must be a numpy, torch or jax array, got "
                         f"{type(planes[bad]).__name__}")
    if len(fws) != 1:
        raise KVABIError(f"cache: planes mix frameworks {sorted(fws)}")
    fw = fws.pop()
    for i, p in enumerate(planes):
        if fw == "jax":
            _check_dense(layout, p, i, fw)
        else:
            _check_strided(layout, p, i, fw)
    return fw


def _check_meta(layout, p, i):
    shape = tuple(p.shape)
    if shape != layout.plane_shape:
        raise KVABIError(f"cache[{i}].shape: must be {layout.plane_shape}, got {shape}")
    try:
        name = dtype_name(p)
    except KVABIError:
        name = str(p.dtype)
    if name != layout.dtype:
        raise KVABIError(f"cache[{i}].dtype: must be the layout's {layout.dtype}, got {name}")


def _check_dense(layout, p, i, fw):
    _check_meta(layout, p, i)
    if not layout.is_c_contiguous:
        raise KVABIError(f"cache[{i}]: {fw} arrays are dense, but layout "
                         f"{layout.name or 'custom'} has padding bytes or explicit strides "
                         f"({layout.plane_nbytes} bytes per plane)")


def _check_strided(layout, p, i, fw):
    _check_meta(layout, p, i)
    isz = layout.itemsize
    strides = tuple(p.stride()) if fw == "torch" else tuple(s // isz for s in p.strides)
    if fw == "numpy" and any(s % isz for s in p.strides):
        raise KVABIError(f"cache[{i}].strides: byte strides {p.strides} are not multiples "
                         f"of the itemsize {isz}")
    want = layout.plane_strides
    for d, (got, exp, n) in enumerate(zip(strides, want, layout.plane_shape)):
        if n > 1 and got != exp:
            raise KVABIError(f"cache[{i}].strides: must be {want} elements (the layout's), "
                             f"got {strides}")
    need = layout.plane_nbytes
    have = _bytes_from_start(p, fw)
    if have < need:
        raise KVABIError(f"cache[{i}]: the layout addresses {need} bytes from the plane's "
                         f"start, but its memory holds only {have}")


def _bytes_from_start(p, fw) -> int:
    """Bytes of memory from the first element of ``p`` to the end of its buffer."""
    if fw == "torch":
        return p.untyped_storage().nbytes() - p.storage_offset() * p.element_size()
    root = p
    while isinstance(getattr(root, "base", None), np.ndarray) or \
            type(getattr(root, "base", None)).__name__ == "DummyArray":
        root = root.base
        if not isinstance(root, np.ndarray):  # as_strided's DummyArray: step through
            root = root.base
    lo, hi = _byte_bounds(root)
    start = p.__array_interface__["data"][0]
    if not lo <= start <= hi:
        return 0
    return hi - start


def _byte_bounds(a):
    bb = getattr(getattr(np.lib, "array_utils", None), "byte_bounds", None)
    return bb(a) if bb is not None else np.byte_bounds(a)  # numpy < 2
