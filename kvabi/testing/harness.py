"""Driving a backend and the reference through one case, and comparing what they leave.

The reference always works on numpy planes that span the layout's whole buffer (padding
included), so :meth:`kvabi.Layout.kv_view` can address them.  A backend's planes cross
the boundary with ``backend.asarray`` / ``backend.to_numpy``: they are copied back into
such full-buffer planes before anything reads them through the layout.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..dtypes import numpy_dtype
from ..layout import Layout
from ..metadata import CommonAttentionMetadata
from .cases import AttentionCase, Inputs, input_dtype
from .measure import ConformanceFailure

#: byte the cache is poisoned with before a case runs (finite in every cache dtype)
SENTINEL = 0xA5

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def full_planes(layout: Layout, fill_byte: int = 0) -> list[np.ndarray]:
    """numpy planes shaped ``layout.plane_shape`` over buffers of ``plane_nbytes`` (padding
    included) whose every byte is ``fill_byte``."""
    dt = numpy_dtype(layout.dtype)
    isz = layout.itemsize
    n = -(-layout.plane_nbytes // isz)
    strides = [s * isz for s in layout.plane_strides]
    out = []
    for _ in range(layout.num_planes):
        buf = np.full(n * isz, fill_byte, np.uint8).view(UINT[isz])
        # Stride an unsigned view: numpy cannot stride some ml_dtypes arrays directly.
        out.append(as_strided(buf, layout.plane_shape, strides).view(dt))
    return out


def copy_planes(layout: Layout, planes) -> list[np.ndarray]:
    """Deep copies of full-buffer numpy planes (padding bytes included)."""
    out = full_planes(layout)
    for dst, src in zip(out, planes):
        raw_items(layout, dst)[...] = raw_items(layout, src)
    return out


def raw_items(layout: Layout, plane: np.ndarray) -> np.ndarray:
    """The whole byte buffer under a full-buffer plane."""
    u = plane.view(UINT[layout.itemsize])
    return as_strided(u, (-(-layout.plane_nbytes // layout.itemsize),), (layout.itemsize,))


def as_cache_dtype(x, dtype: str) -> np.ndarray:
    """A backend's plane as numpy in the cache dtype: raw unsigned bits are reinterpreted,
    wider floats (an upcast copy) converted back exactly."""
    a = np.asarray(x)
    dt = numpy_dtype(dtype)
    if a.dtype == dt:
        return a
    if a.dtype.kind in "ui" and a.dtype.itemsize == dt.itemsize:
        return a.view(dt)
    return a.astype(dt)


def fill_pool(layout: Layout, planes, inputs: Inputs, spec) -> None:
    """Write every slot of every layer of numpy ``planes`` from the case's pool."""
    dt = numpy_dtype(spec.dtype)
    shape = (layout.num_blocks, spec.block_size) + inputs.pool_k.shape[2:]
    for layer in range(layout.num_layers):
        layout.kv_view(planes, layer, 0)[...] = inputs.pool_k[layer].astype(dt).reshape(shape)
        if inputs.pool_v is not None:
            vshape = shape[:-1] + (inputs.pool_v.shape[-1],)
            layout.kv_view(planes, layer, 1)[...] = \
                inputs.pool_v[layer].astype(dt).reshape(vshape)


def fill_meta(layout: Layout, block_size: int) -> CommonAttentionMetadata:
    """One request writing every slot of the pool, block by block in order."""
    nb = layout.num_blocks
    return CommonAttentionMetadata.from_lengths(
        [nb * block_size], [0], np.arange(nb)[None, :], block_size, num_blocks=nb)


def oracle_cache(case: AttentionCase, *, via_backend_allocate: bool) -> list[np.ndarray]:
    """The reference's starting cache: poisoned with :data:`SENTINEL` (zeros where the
    backend's own zeroed allocation is used instead), then every slot from the pool."""
    planes = full_planes(case.layout, 0 if via_backend_allocate else SENTINEL)
    fill_pool(case.layout, planes, case.inputs(), case.spec)
    return planes


def backend_cache(backend, case: AttentionCase):
    """The backend's starting cache, equal to :func:`oracle_cache`.

    A C-contiguous layout is poisoned and filled in numpy and handed over with
    ``backend.asarray``; any other goes through ``backend.allocate`` and a write of every
    slot through the backend itself.
    """
    layout, spec, inputs = case.layout, case.spec, case.inputs()
    if use_asarray(layout):
        planes = oracle_cache(case, via_backend_allocate=False)
        return [backend.asarray(np.array(p)) for p in planes]
    cache = backend.allocate(layout)
    meta = fill_meta(layout, spec.block_size)
    plan = backend.plan(meta, spec, layout)
    for layer in range(layout.num_layers):
        k = backend.asarray(inputs.pool_k[layer])
        v = None if inputs.pool_v is None else backend.asarray(inputs.pool_v[layer])
        cache = backend.write_kv(cache, layout, k, v, plan, layer=layer)
    return cache


def use_asarray(layout: Layout) -> bool:
    return layout.is_c_contiguous


def to_planes(backend, layout: Layout, cache) -> list[np.ndarray]:
    """A backend's cache as full-buffer numpy planes (checked for count, shape, dtype)."""
    if not isinstance(cache, (list, tuple)) or len(cache) != layout.num_planes:
        raise ConformanceFailure(f"cache: expected a list of {layout.num_planes} planes, got "
                                 f"{type(cache).__name__} of {len(cache) if hasattr(cache, '__len__') else '?'}")
    out = full_planes(layout, 0)
    for i, p in enumerate(cache):
        a = backend.to_numpy(p)
        if tuple(a.shape) != layout.plane_shape:
            raise ConformanceFailure(f"cache plane {i}: shape {tuple(a.shape)}, the layout "
                                     f"says {layout.plane_shape}")
        try:
            out[i][...] = as_cache_dtype(a, layout.dtype)
        except (TypeError, ValueError) as e:
            raise ConformanceFailure(f"cache plane {i}: dtype {a.dtype} is not the layout's "
                                     f"{layout.dtype}: {e}") from e
    return out


def cache_difference(layout: Layout, spec, got, want) -> str | None:
    """None when two full-buffer plane lists hold the same visible bytes, else a
    description naming the (layer, K/V, slot) entries that differ."""
    bad_planes = []
    u = UINT[layout.itemsize]
    for i, (a, b) in enumerate(zip(got, want)):
        if not np.array_equal(a.view(u), b.view(u)):
            bad_planes.append(i)
    if not bad_planes:
        return None
    parts = []
    for layer in range(layout.num_layers):
        for kv in (range(2) if layout.has_kv else range(1)):
            a = layout.kv_view(got, layer, kv).view(u)
            b = layout.kv_view(want, layer, kv).view(u)
            diff = (a != b).reshape(a.shape[0] * a.shape[1], -1).any(axis=1)
            slots = np.nonzero(diff)[0]
            if len(slots):
                name = ("latent" if not layout.has_kv else "KV"[kv])
                parts.append(f"layer {layer} {name}: {len(slots)} slot(s) differ, first "
                             f"{slots[:6].tolist()}")
    if not parts:
        parts.append(f"bytes outside the logical elements (padding) differ in planes "
                     f"{bad_planes}")
    return "; ".join(parts)


def expect_same_cache(what: str, layout: Layout, spec, got, want, *, written=None) -> None:
    """Raise :class:`ConformanceFailure` unless the caches are byte-identical."""
    d = cache_difference(layout, spec, got, want)
    if d is not None:
        extra = "" if written is None else f"; the step writes slots {list(written)[:12]}"
        raise ConformanceFailure(f"{what}: cache bytes differ from the reference: {d}{extra}")


class Runner:
    """One side (backend or reference) of a case: its cache and calls with numpy in/out."""

    def __init__(self, backend, case: AttentionCase, *, oracle: bool):
        self.backend = backend
        self.case = case
        self.oracle = oracle
        self.layout = case.layout
        self.spec = case.spec
        if oracle:
            self.cache = oracle_cache(case, via_backend_allocate=not use_asarray(case.layout))
        else:
            self.cache = backend_cache(backend, case)

    def _x(self, a):
        if a is None:
            return None
        return a if self.oracle else self.backend.asarray(a)

    def plan(self, meta, spec=None, *, sinks=True):
        c = self.case
        s = c.inputs().sinks if (sinks and c.sinks) else None
        return self.backend.plan(meta, spec or self.spec, self.layout, scale=c.scale,
                                 softcap=c.softcap, sinks=self._x(s))

    def write(self, plan, key, value, layer=None):
        layer = self.case.layer if layer is None else layer
        self.cache = self.backend.write_kv(self.cache, self.layout, self._x(key),
                                           self._x(value), plan, layer=layer)
        if self.cache is None:
            raise ConformanceFailure("write_kv returned None; it must return the cache")

    def attend(self, plan, query, layer=None, *, lse=False):
        """(out, lse or None) as float64 numpy."""
        layer = self.case.layer if layer is None else layer
        got = self.backend.attention(self._x(query), self.cache, self.layout, plan,
                                     layer=layer, return_lse=lse)
        if lse:
            if not isinstance(got, tuple) or len(got) != 2:
                raise ConformanceFailure("attention(return_lse=True) must return (out, lse)")
            out, l_ = got
            return self._np(out), self._np(l_)
        if isinstance(got, tuple):
            raise ConformanceFailure("attention(return_lse=False) returned a tuple")
        return self._np(got), None

    def _np(self, x):
        a = np.asarray(x if self.oracle else self.backend.to_numpy(x))
        return a.astype(np.float64)

    def planes(self) -> list[np.ndarray]:
        if self.oracle:
            return self.cache
        return to_planes(self.backend, self.layout, self.cache)


def step_inputs(case: AttentionCase, rows=None):
    """(key, value, query) of the step, optionally gathered at token ``rows``."""
    i = case.inputs()
    k, v, q = i.key, i.value, i.query
    if rows is not None:
        k, q = k[rows], q[rows]
        v = None if v is None else v[rows]
    return k, v, q


__all__ = ["SENTINEL", "Runner", "as_cache_dtype", "backend_cache", "cache_difference",
           "copy_planes", "expect_same_cache", "fill_meta", "fill_pool", "full_planes",
           "input_dtype", "oracle_cache", "raw_items", "step_inputs", "to_planes"]
