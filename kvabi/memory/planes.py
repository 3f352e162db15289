"""Cache planes checked against a layout: the one check of memory entering kvabi
(``specs/security.md`` section 2).

:func:`check_planes` takes anything with a layout's attributes (``num_planes``,
``plane_shape``, ``plane_strides``, ``plane_nbytes``, ``dtype``...) and a list of planes, and
checks the number of planes, each plane's framework, shape, dtype and strides, and that the
memory under each plane reaches the furthest byte the layout addresses (a plane of the right
shape over too small a buffer is refused, never written past).  It sits below
:mod:`kvabi.layout.descriptor` and :mod:`kvabi.memory.cache`, which both call it.
"""
from __future__ import annotations

import numpy as np

from ..util.errors import KVABIError
from ..util.tensors import dtype_name, framework


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
        check_plane(layout, p, i, fw)
    if fw == "torch":
        check_torch_devices(planes)
    return fw


def check_plane(layout, p, i, fw):
    """Plane ``i`` (of framework ``fw``) against ``layout``: shape, dtype, and for numpy and
    torch (strided memory) element strides and the memory under it.  A component layout's
    planes are bytes: a numpy or torch array of the layout's dtype (or ``uint8``), of any
    shape, whose memory from its first element holds the plane's bytes (the components'
    views are made over those bytes)."""
    if not layout.is_axis_form:
        if fw == "jax":
            raise KVABIError(f"cache[{i}]: jax arrays have no strided views; "
                             f"{layout.name or 'this layout'} is stated by components")
        if fw == "torch":
            check_torch(p, i)
        try:
            name = dtype_name(p)
        except KVABIError:
            name = str(p.dtype)
        if name != layout.dtype and not str(p.dtype).endswith("uint8"):
            raise KVABIError(f"cache[{i}].dtype: must be the layout's {layout.dtype} (or "
                             f"uint8 bytes), got {name}")
        need = layout.plane_size(i)
        have = _bytes_from_start(p, fw)
        if have < need:
            raise KVABIError(f"cache[{i}]: the layout addresses {need} bytes from the "
                             f"plane's start, but its memory holds only {have}")
        return
    if fw == "jax":
        _check_dense(layout, p, i, fw)
        return
    if fw == "torch":
        check_torch(p, i)
    _check_strided(layout, p, i, fw)


def check_torch(p, i):
    """A torch plane must be strided memory kvabi can address: not a meta tensor (no
    memory at all: a write would store nothing), not sparse."""
    import torch

    if p.is_meta or p.device.type == "meta":
        raise KVABIError(f"cache[{i}].device: a meta tensor holds no memory; planes must "
                         f"be real memory")
    if p.layout is not torch.strided:
        raise KVABIError(f"cache[{i}].layout: must be a strided (dense) tensor, got "
                         f"{p.layout}")


def check_torch_devices(planes):
    """Every torch plane of one cache on one device."""
    devs = {str(p.device) for p in planes}
    if len(devs) > 1:
        raise KVABIError(f"cache: planes lie on several devices {sorted(devs)}")


def _check_shape_dtype(layout, p, i):
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
    _check_shape_dtype(layout, p, i)
    if not layout.is_c_contiguous:
        raise KVABIError(f"cache[{i}]: {fw} arrays are dense, but layout "
                         f"{layout.name or 'custom'} has padding bytes or explicit strides "
                         f"({layout.plane_nbytes} bytes per plane)")


def _check_strided(layout, p, i, fw):
    _check_shape_dtype(layout, p, i)
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


def byte_span(x, fw):
    """``(device, first byte, end byte)`` of the memory the elements of a numpy or torch
    array occupy (None for jax arrays and empty arrays): two arrays alias when their spans
    on one device overlap."""
    if fw == "numpy":
        return None if x.size == 0 else ("cpu",) + tuple(_byte_bounds(x))
    if fw == "torch":
        if x.numel() == 0:
            return None
        start = x.data_ptr()
        last = sum((n - 1) * s for n, s in zip(x.shape, x.stride()))
        return str(x.device), start, start + (last + 1) * x.element_size()
    return None


def overlaps(a, b) -> bool:
    """Whether two :func:`byte_span` results share a byte."""
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def plane_stamp(p, fw):
    """What must not change in a plane (or a view of it) after its check: compared at use
    by :class:`kvabi.KVCache` (see ``KVCache.check_unchanged``)."""
    if fw == "torch":
        s = p.untyped_storage()
        return s.data_ptr(), s.nbytes(), p.storage_offset(), p.stride(), p.shape
    if fw == "numpy":
        return p.shape, p.strides
    return None
