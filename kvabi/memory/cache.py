"""The KV cache handle a step passes around: a layout, its planes, and the per-layer views
computed once.

:class:`KVCache` is where cache memory enters kvabi, so it is where that memory is checked
against the layout, once: the number of planes, each plane's shape, dtype and strides, and
that the memory under each plane reaches the furthest byte the layout addresses (a plane of
the right shape over too small a buffer is refused, never written past).  Behind the check,
a view costs a dictionary lookup.  A KVCache is a tuple of its planes (``cache[i]``,
``len(cache)``); backends take nothing else as a cache.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..layout.descriptor import check_layout as _check_layout
from ..util.coerce import as_int, is_int
from ..util.errors import FrozenError, KVABIError
from ..util.tensors import framework, torch_dtype
from .planes import (byte_span, check_plane, check_planes, check_torch, check_torch_devices,
                     plane_stamp)
from .views import allocate_numpy, component_view, layer_view


class KVCache(tuple):
    """An immutable tuple of planes bound to a :class:`~kvabi.Layout`.

    Build with :meth:`wrap` (memory an engine owns: numpy, torch or jax arrays) or get one
    from ``backend.allocate(layout)``.  numpy and torch planes are written in place; jax
    arrays are immutable, so a jax write returns a new handle (:meth:`replace`).

    Its attributes cannot be rebound (``layout``, ``framework``): code that trusts a handle
    by identity (``Backend.write_kv``) trusts what was checked.  What a caller can still change
    is the planes' own state (a torch ``set_()``, a storage ``resize_()``, a numpy
    ``shape``/``strides`` assignment): a fingerprint of each plane is kept at wrap and
    compared where the plane is used (:meth:`check_unchanged`, and every view lookup).
    """

    # (a tuple subclass cannot have __slots__: attributes live in the instance dict,
    # written once in __new__ and refused afterwards by __setattr__)

    def __new__(cls, layout, planes, _checked: bool = False, _stamps=None):
        if not _checked:
            _check_layout(layout)
            fw = check_planes(layout, planes)
        else:
            fw = framework(planes[0]) if planes else "numpy"
        self = super().__new__(cls, planes)
        put = object.__setattr__
        put(self, "layout", layout)
        put(self, "framework", fw)
        put(self, "_views", {})
        put(self, "_stamps", tuple(plane_stamp(p, fw) for p in planes) if _stamps is None
            else _stamps)
        return self

    def __setattr__(self, name, value):
        raise FrozenError(f"KVCache.{name}: a KVCache cannot be changed after its check; "
                          f"wrap the planes again")

    def __delattr__(self, name):
        raise FrozenError(f"KVCache.{name}: a KVCache cannot be changed after its check")

    @classmethod
    def wrap(cls, layout, planes) -> "KVCache":
        """A handle over ``planes`` after checking them against ``layout`` (KVABIError
        naming the plane and what is wrong).  A KVCache of the same layout is returned
        as it is."""
        _check_layout(layout)
        if type(planes) is KVCache and (planes.layout is layout or planes.layout == layout):
            return planes
        return cls(layout, tuple(planes) if isinstance(planes, (list, tuple)) else planes)

    @classmethod
    def allocate(cls, layout, framework: str = "numpy", *, device=None,
                 fill: int = 0) -> "KVCache":
        """Planes for ``layout`` whose every byte (padding included) is ``fill``, a byte
        value 0..255 (``0xA5`` gives bytes 0xA5, whatever the dtype), in ``framework``
        ("numpy", "torch", "jax"); strided over a buffer of ``layout.plane_nbytes`` so byte
        offsets match the layout (jax: dense layouts only)."""
        _check_layout(layout)
        fill = as_int(fill, "fill", lo=0, hi=255)
        if framework not in ("numpy", "torch", "jax"):
            raise KVABIError(f"framework: must be numpy, torch or jax, got {framework!r:.60}")
        if framework == "numpy":
            return cls(layout, tuple(allocate_numpy(layout, fill, bytewise=True)),
                       _checked=True)
        if framework == "torch":
            import torch

            if device is not None:
                try:
                    device = torch.device(device)
                except (RuntimeError, TypeError, ValueError):
                    raise KVABIError(f"device: not a torch device, got {device!r:.60}") from None
            axis = layout.is_axis_form
            # host planes from numpy's allocator: it asks for transparent huge pages on large
            # buffers, torch's does not (execute on torch planes ran 0.72x numpy's without)
            host = (device if device is not None else torch.empty(0).device).type == "cpu"
            planes = []
            sizes = [layout.plane_nbytes] * layout.num_planes if axis else layout.plane_sizes
            for size in sizes:
                nbytes = -(-size // layout.itemsize) * layout.itemsize
                try:  # a device that is not there, or too little memory on it
                    buf = (torch.from_numpy(np.full(nbytes, fill, np.uint8)) if host else
                           torch.full((nbytes,), fill, dtype=torch.uint8, device=device))
                except (RuntimeError, AssertionError, MemoryError) as e:  # CPU-only torch asserts
                    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                    raise KVABIError(f"device: cannot allocate {layout.num_planes} planes of "
                                     f"{nbytes} bytes on {device or 'the default device'}: "
                                     f"{why:.200}") from None
                typed = buf.view(torch_dtype(layout.dtype))
                planes.append(typed.as_strided(layout.plane_shape, layout.plane_strides)
                              if axis else typed)
                check_torch(planes[-1], len(planes) - 1)
            return cls(layout, tuple(planes), _checked=True)
        import jax.numpy as jnp

        if not layout.is_c_contiguous:
            raise KVABIError(f"layout: {layout.name or 'custom'} has padding bytes or "
                             f"explicit strides; jax arrays are dense")
        return cls(layout, tuple(jnp.asarray(p) for p in
                                 allocate_numpy(layout, fill, bytewise=True)), _checked=True)

    @property
    def planes(self) -> tuple:
        return tuple(self)

    def replace(self, planes) -> "KVCache":
        """A handle of the same layout over new planes (after a jax write), checked."""
        return KVCache(self.layout, tuple(planes))

    def replace_planes(self, updates) -> "KVCache":
        """A handle where plane ``i`` is ``updates[i]`` (for jax writes that produce new
        arrays of some planes).  Each new plane gets the full check :meth:`wrap` makes
        (framework, shape, dtype, strides, memory); the others keep theirs."""
        if not isinstance(updates, Mapping):
            raise KVABIError(f"updates: must be a mapping plane index -> plane, got "
                             f"{type(updates).__name__}")
        planes, stamps = list(self), list(self._stamps)
        n = len(planes)
        for i, p in updates.items():
            i = _plane_index(i, n, "updates: keys must be")
            fw = framework(p)
            if fw != self.framework:
                raise KVABIError(f"cache[{i}]: must be a {self.framework} array like the "
                                 f"other planes, got {type(p).__name__}")
            check_plane(self.layout, p, i, fw)
            planes[i], stamps[i] = p, plane_stamp(p, fw)
        if self.framework == "torch":
            check_torch_devices(planes)
        return KVCache(self.layout, tuple(planes), _checked=True, _stamps=tuple(stamps))

    def check_unchanged(self, planes=None) -> None:
        """KVABIError unless every plane (or the plane indices in ``planes``) is as it was
        when checked: for torch the storage (data pointer and bytes), offset, shape and
        strides; for numpy the shape and strides (jax arrays cannot change).  Cheap
        (a few attribute reads per plane): code that reads or writes the planes
        themselves, rather than through :meth:`kv_view`/:meth:`layer_view` (which check
        the plane they view), calls it first."""
        if self.framework == "jax":
            return
        n = len(self)
        if planes is not None and not isinstance(planes, (list, tuple, range, np.ndarray)):
            raise KVABIError(f"planes: must be a list of plane indices, got "
                             f"{type(planes).__name__}")
        for i in range(n) if planes is None else planes:
            if type(i) is not int or not 0 <= i < n:
                i = _plane_index(i, n, "planes: must hold")
            if plane_stamp(self[i], self.framework) != self._stamps[i]:
                _changed(self, i)

    def layer_view(self, layer: int) -> tuple:
        """The layout's per-layer tensors (see :meth:`kvabi.Layout.layer_view`), cached."""
        if type(layer) is not int:
            layer = as_int(layer, "layer")
        hit = self._views.get(("layer", layer))
        if hit is None:
            kvs = (0, 1) if "KV" in self.layout.planes else (0,)
            idx = tuple(self.layout.plane_index(layer, kv) for kv in kvs)
            self.check_unchanged(idx)  # before any view is made from the planes
            v = layer_view(self.layout, self, layer)
            hit = self._views[("layer", layer)] = (v, idx, tuple(
                plane_stamp(t, self.framework) for t in v))
        if self.framework != "jax":
            for i, t, st in zip(hit[1], hit[0], hit[2]):
                self._check_view(i, t, st)
        return hit[0]

    def kv_view(self, layer: int, kv: int):
        """Strided [B, N, H, D] view of the keys (kv=0) or values (kv=1) of ``layer``
        (the MLA latent: kv=0), numpy and torch planes, writes go through; cached."""
        if type(kv) is not int:
            kv = as_int(kv, "kv")
        if not 0 <= kv < (2 if self.layout.has_kv else 1):
            raise KVABIError(f"kv: {kv} out of range [0, {2 if self.layout.has_kv else 1})")
        return self.component_view(("key", "value")[kv] if self.layout.has_kv else "latent",
                                   layer)

    def component_view(self, name: str, layer: int):
        """Strided ``[B, N, H, E]`` view of component ``name`` of ``layer`` in its own dtype
        (``kvabi.memory.views.component_view``: size 1 along axes it does not vary along; packed
        dtypes as their bytes), numpy and torch planes, writes go through; cached."""
        if type(layer) is not int:
            layer = as_int(layer, "layer")
        hit = self._views.get((name, layer))
        if hit is None:
            if self.framework == "jax":
                raise KVABIError("cache: jax planes have no strided views; use layer_view")
            from ..layout.check import check_layer

            c = self.layout.component(name)
            i = c.plane + check_layer(layer, self.layout) * c.plane_strides.get("L", 0)
            self.check_unchanged((i,))  # before any view is made from the plane
            v = component_view(self.layout, self, name, layer)
            hit = self._views[(name, layer)] = (v, i, plane_stamp(v, self.framework))
        self._check_view(hit[1], hit[0], hit[2])
        return hit[0]

    def layer_spans(self, layer: int) -> tuple:
        """:func:`kvabi.memory.planes.byte_span` of each plane holding ``layer`` (an index already
        checked), computed once: what an ``out=`` buffer must not overlap."""
        hit = self._views.get(("spans", layer))
        if hit is None:
            kvs = (0, 1) if "KV" in self.layout.planes else (0,)
            idx = dict.fromkeys(self.layout.plane_index(layer, kv) for kv in kvs)
            self.check_unchanged(tuple(idx))
            hit = self._views[("spans", layer)] = tuple(byte_span(self[i], self.framework)
                                                        for i in idx)
        return hit

    def _check_view(self, i, view, stamp):
        """The plane under a cached view, and the view itself (handed out, so a caller
        could reshape or re-point it), are as they were checked."""
        fw = self.framework
        if plane_stamp(self[i], fw) != self._stamps[i]:
            _changed(self, i)
        if plane_stamp(view, fw) != stamp:
            raise KVABIError(f"cache[{i}]: a view of this plane was changed in place after "
                             f"kvabi made it (shape, strides or storage); views are read "
                             f"and written through, never re-pointed")

    def __repr__(self) -> str:
        what = (f"{self.layout.plane_shape} {self.layout.dtype}" if self.layout.is_axis_form
                else "components " + ", ".join(self.layout.component_names))
        return (f"KVCache({self.layout.name or 'custom'}, {len(self)} {self.framework} "
                f"planes of {what})")

    # Identity semantics: planes are arrays, whose == is elementwise.
    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    __hash__ = object.__hash__

    def __reduce__(self):
        return (KVCache, (self.layout, tuple(self)))


def _plane_index(i, n: int, what: str) -> int:
    """``i`` as a plane index in ``[0, n)``: an integer (numpy and torch welcome; no bool,
    string or negative index, which would silently name the last plane)."""
    if not is_int(i) or not 0 <= i < n:
        raise KVABIError(f"{what} plane indices in [0, {n}), got {i!r:.60}")
    return int(i)


def _changed(cache, i):
    raise KVABIError(f"cache[{i}]: the plane changed after KVCache.wrap checked it (its "
                     f"storage, offset, shape or strides); wrap the planes again")
