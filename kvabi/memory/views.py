"""Memory seen through a layout: planes allocated for it, and strided views of its
components (no copy; writes go through).  :class:`kvabi.KVCache` calls these behind its
one check of the planes (``kvabi.memory.planes``) and caches the views; a layout itself holds no
memory and makes no view.
"""
from __future__ import annotations

import numpy as np

from ..layout.check import check_layer
from ..util.coerce import as_int
from ..util.dtypes import numpy_dtype
from ..util.errors import KVABIError

#: the logical axes of every component view, in order
VIEW_AXES = ("B", "N", "H", "E")


def _as_strided(x: np.ndarray, shape, strides) -> np.ndarray:
    """``as_strided`` that also works for ml_dtypes float8_e5m2, whose array-interface
    typestr numpy cannot parse: stride an unsigned-int view and view it back."""
    raw = x.view(np.dtype(f"u{x.dtype.itemsize}"))
    return np.lib.stride_tricks.as_strided(raw, shape, strides).view(x.dtype)


def allocate_numpy(layout, fill=0, *, bytewise: bool = False) -> list[np.ndarray]:
    """Planes for ``layout`` as numpy arrays: shaped :attr:`~kvabi.Layout.plane_shape`
    (strided over a padded buffer where the layout pads) in the axis form, flat arrays of
    the layout's dtype over each plane's bytes in the component form.  Every element of the buffer,
    padding included, holds the value ``fill`` (e.g. NaN; in the component form components
    of another dtype hold its bytes); with ``bytewise`` every byte holds ``fill``, a byte
    value 0..255."""
    if not layout.is_axis_form:  # flat planes of the layout's dtype, whole elements
        dt, isz = numpy_dtype(layout.dtype), layout.itemsize
        if bytewise:
            fill = as_int(fill, "fill", lo=0, hi=255)
            return [np.full(-(-n // isz) * isz, fill, np.uint8).view(dt)
                    for n in layout.plane_sizes]
        if not isinstance(fill, (int, float, np.integer, np.floating)) or \
                isinstance(fill, (bool, np.bool_)):
            raise KVABIError(f"fill: must be a number, got {fill!r:.60}")
        try:  # components of another dtype (scales) hold these bytes
            return [np.full(-(-n // isz), fill, dtype=dt) for n in layout.plane_sizes]
        except (OverflowError, ValueError):
            raise KVABIError(f"fill: {fill!r} is not a {layout.dtype} value") from None
    dt = numpy_dtype(layout.dtype)
    isz = layout.itemsize
    n = -(-layout.plane_nbytes // isz)
    if bytewise:
        fill = as_int(fill, "fill", lo=0, hi=255)
    elif not isinstance(fill, (int, float, np.integer, np.floating)) or \
            isinstance(fill, (bool, np.bool_)):
        raise KVABIError(f"fill: must be a number, got {fill!r:.60}")
    strides = [s * isz for s in layout.plane_strides]
    planes = []
    for _ in range(layout.num_planes):
        if bytewise:
            buf = np.full(n * isz, fill, dtype=np.uint8).view(dt)
        else:
            try:
                buf = np.full(n, fill, dtype=dt)
            except (OverflowError, ValueError):
                raise KVABIError(f"fill: {fill!r} is not a {layout.dtype} value") from None
        planes.append(_as_strided(buf, layout.plane_shape, strides))
    return planes


def layer_view(layout, planes, layer: int) -> tuple:
    """Per-layer tensors of an axis-form layout: ``(t,)`` when K and V share a plane (or
    MLA), ``(k, v)`` when KV is a plane axis.  The L dimension, if in a plane, is indexed
    away (no copy for numpy and torch; jax slices).  ``planes`` are already checked."""

    if not layout.is_axis_form:
        raise KVABIError(f"layer_view: {layout.name or 'this layout'} is stated by "
                         f"components and has no per-layer tensor; use component_view")
    layer = check_layer(layer, layout)
    kvs = range(2) if "KV" in layout.planes else range(1)
    out = []
    for kv in kvs:
        t = planes[int(layout._plane_of(layer, kv))]
        if "L" in layout.order:
            axes = layout.view_axes
            dim = axes.index(("L",)) if ("L",) in axes else None
            if dim is None:
                raise KVABIError("layer: L is folded with another axis; no per-layer view")
            t = t[(slice(None),) * dim + (layer,)]
        out.append(t)
    return tuple(out)


def _byte_base(plane, nbytes: int) -> np.ndarray:
    """The ``nbytes`` bytes of a numpy plane from its first element, as a flat uint8
    array over the same memory (checked to be there by ``kvabi.memory.planes``)."""
    isz = plane.dtype.itemsize
    flat = _as_strided(plane, (-(-nbytes // isz),), (isz,))
    return flat.view(np.uint8)[:nbytes]


def component_view(layout, planes, name: str, layer: int):
    """Strided view ``[B, N, H, E]`` (no copy) of component ``name`` of ``layer``: the
    component's dtype (``uint8`` bytes of two elements each for packed dtypes), size 1
    along the axes it does not vary along.  numpy arrays and torch tensors; writes go
    through.  ``planes`` are already checked against ``layout``."""

    c = layout.component(name)
    layer = check_layer(layer, layout)
    ps = c.plane_strides.get("L")
    p = c.plane + layer * ps if ps else c.plane
    base = c.offset + layer * c.strides.get("L", 0)
    shape = tuple((c.units if a == "E" else layout.size(a)) if a in c.strides or
                  (a == "E") else 1 for a in VIEW_AXES)
    strides = tuple(c.strides.get(a, 0) if a != "E" else c.elem_stride for a in VIEW_AXES)
    plane = planes[p]
    if isinstance(plane, np.ndarray):
        flat = _byte_base(plane, layout.plane_size(p))
        return np.ndarray(shape, numpy_dtype(c.dtype), flat, base, strides)
    if hasattr(plane, "untyped_storage"):  # torch
        import torch

        from ..util.tensors import torch_dtype

        tdt = torch_dtype(c.dtype)
        start = plane.storage_offset() * plane.element_size() + base
        if start % c.unit:
            raise KVABIError(f"cache[{p}]: component {name} starts at byte {start} of its "
                             f"storage, not a multiple of its {c.unit}-byte {c.dtype}")
        t = torch.empty(0, dtype=tdt, device=plane.device)
        return t.set_(plane.untyped_storage(), start // c.unit, shape,
                      tuple(s // c.unit for s in strides))
    raise KVABIError(f"planes: views need numpy or torch arrays, got {type(plane)}")


def kv_view(layout, planes, layer: int, kv: int):
    """Strided view [B, N, H, D] of the keys (kv=0), values (kv=1) or MLA latent of one
    layer: :func:`component_view` of that component."""
    kv = as_int(kv, "kv", lo=0, hi=1 if layout.has_kv else 0)
    name = ("key", "value")[kv] if layout.has_kv else "latent"
    return component_view(layout, planes, name, layer)
