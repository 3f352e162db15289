"""Driving a backend and the reference through one case, and comparing what they leave.

The reference always works on numpy planes that span the layout's whole buffer (padding
included), so :meth:`kvabi.Layout.kv_view` can address them.  Arrays cross the boundary
with :func:`kvabi.tensors.convert` into the backend's ``framework``; caches are handed as
:class:`kvabi.KVCache`, and the kit always continues with the cache a write returns (a jax
cache is consumed by the write).  A backend's planes are copied back into full-buffer
numpy planes before anything reads them through the layout.

Every call is the ABI's keyword call (``plan(..., num_q_heads=)``, ``write_kv(plan, cache,
key=, value=, layer=)``, ``attention(plan, cache, query=, ...)``); the reference, as the
oracle, gets per-call sinks as a plan of their own, so the oracle does not depend on the
features under test.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..layout.descriptor import Layout
from ..memory.cache import KVCache
from ..step.metadata import CommonAttentionMetadata
from ..util.dtypes import numpy_dtype
from ..util.errors import KVABIError
from ..util.tensors import convert, to_numpy
from .cases import AttentionCase, input_dtype, stored
from .measure import ConformanceFailure

#: byte the cache is poisoned with before a case runs (finite in every cache dtype)
SENTINEL = 0xA5

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


# -- the boundary -------------------------------------------------------------------------
def in_framework(backend, x):
    """``x`` (numpy) in the backend's framework, on its device."""
    return None if x is None else convert(x, backend.framework, device=backend.device())


def take_cache(layout: Layout, cache, what: str) -> KVCache:
    """The cache a backend returned (from ``allocate`` or ``write_kv``): a KVCache of
    ``layout``, as the kit hands it on."""
    if type(cache) is not KVCache:
        raise ConformanceFailure(f"{what} returned a {type(cache).__name__}, not a "
                                 f"kvabi.KVCache")
    if cache.layout != layout:
        raise ConformanceFailure(f"{what} returned a cache of another layout "
                                 f"({cache.layout.name or 'custom'})")
    return cache


def dtype_str(x) -> str:
    """The dtype name of a numpy, torch or jax array (``float32``, ``bfloat16``, ...)."""
    return str(getattr(x, "dtype", "?")).replace("torch.", "")


def is_reference(backend) -> bool:
    """The numpy oracle (and its subclasses) returns float64 outputs and lse."""
    from ..backend.reference import ReferenceBackend

    return isinstance(backend, ReferenceBackend)


# -- numpy planes -------------------------------------------------------------------------
def plane_shape(layout: Layout, i: int) -> tuple[int, ...]:
    """The shape of plane ``i``: ``layout.plane_shape``, or for a component layout a flat
    array over that plane's own bytes (component planes may differ in size)."""
    if layout.is_axis_form:
        return layout.plane_shape
    return (-(-layout.plane_size(i) // layout.itemsize),)


def full_planes(layout: Layout, fill_byte: int = 0) -> list[np.ndarray]:
    """numpy planes shaped :func:`plane_shape` over buffers of the plane's bytes (padding
    included) whose every byte is ``fill_byte``."""
    dt = numpy_dtype(layout.dtype)
    isz = layout.itemsize
    strides = [s * isz for s in layout.plane_strides]
    out = []
    for i in range(layout.num_planes):
        n = -(-layout.plane_nbytes // isz) if layout.is_axis_form else plane_shape(layout, i)[0]
        buf = np.full(n * isz, fill_byte, np.uint8).view(UINT[isz])
        # Stride an unsigned view: numpy cannot stride some ml_dtypes arrays directly.
        out.append(as_strided(buf, plane_shape(layout, i), strides).view(dt))
    return out


def _handle(layout: Layout, planes):
    """A KVCache over the kit's own numpy planes (checked once; views are lookups)."""
    if isinstance(planes, KVCache) and planes.layout == layout:
        return planes
    return KVCache(layout, tuple(planes), _checked=True)


def copy_planes(layout: Layout, planes) -> list[np.ndarray]:
    """Deep copies of full-buffer numpy planes (padding bytes included)."""
    out = full_planes(layout)
    for dst, src in zip(out, planes):
        raw_items(layout, dst)[...] = raw_items(layout, src)
    return out


def raw_items(layout: Layout, plane: np.ndarray) -> np.ndarray:
    """The whole byte buffer under a full-buffer plane (a component layout's: the flat
    plane itself)."""
    u = plane.view(UINT[layout.itemsize])
    if not layout.is_axis_form:
        return u.reshape(-1)
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


def fill_pool(layout: Layout, planes, pool_k, pool_v, spec, scales=None) -> None:
    """Write every slot of every layer of numpy ``planes`` from a pool
    ([L, slots, H, D] arrays); ``scales(layer)``: a layer's static scales as call keywords
    (a quantized cache holds the pool's codes under them, ``specs/semantics.md`` 11)."""
    cache = _handle(layout, planes)
    for layer in range(layout.num_layers):
        sc = {} if scales is None else scales(layer)
        for kv, pool in enumerate((pool_k, pool_v)):
            if pool is not None:
                put_rows(cache, spec, layer, kv, slice(None), pool[layer], sc)


def put_rows(cache, spec, layer: int, kv: int, slots, rows, scales: dict) -> None:
    """Store ``rows`` [S, H, D] of K (``kv`` 0) or V at ``slots`` (an index array, or all
    slots) of ``layer`` of a KVCache as a write would (:func:`~kvabi.testing.cases.stored`:
    codes, and a per_token_head cache's row scales in its scale component)."""
    codes, row_scales = stored(spec, rows, kv, scales)
    view = cache.kv_view(layer, kv)
    bs = spec.block_size
    if isinstance(slots, slice):
        view[...] = codes.reshape(view.shape[:3] + codes.shape[-1:])
    else:
        view[slots // bs, slots % bs] = codes
    if row_scales is not None:
        sview = cache.component_view(("key_scale", "value_scale")[kv], layer)
        if isinstance(slots, slice):
            sview[...] = row_scales.reshape(sview.shape)
        else:
            sview[slots // bs, slots % bs, :, 0] = row_scales


def fill_meta(layout: Layout, block_size: int) -> CommonAttentionMetadata:
    """One request writing every slot of the pool, block by block in order."""
    nb = layout.num_blocks
    return CommonAttentionMetadata.from_lengths(
        [nb * block_size], [0], np.arange(nb)[None, :], block_size, num_blocks=nb)


def oracle_cache(case: AttentionCase, *, via_backend_allocate: bool, pool=None
                 ) -> list[np.ndarray]:
    """The starting cache: poisoned with :data:`SENTINEL` (zeros where the backend's own
    zeroed allocation is used instead), then every slot from the pool (the case's, or
    ``pool`` = (pool_k, pool_v))."""
    planes = full_planes(case.layout, 0 if via_backend_allocate else SENTINEL)
    i = case.inputs()
    pk, pv = (i.pool_k, i.pool_v) if pool is None else pool
    fill_pool(case.layout, planes, pk, pv, case.spec, case.scales)
    return planes


def backend_cache(backend, case: AttentionCase, pool=None):
    """The backend's starting cache, equal to :func:`oracle_cache` (with the same
    ``pool``).

    A C-contiguous layout is poisoned and filled in numpy and handed over in the backend's
    framework; any other goes through ``backend.allocate`` and a write of every slot
    through the backend itself.
    """
    layout, spec, inputs = case.layout, case.spec, case.inputs()
    if use_host_planes(layout):
        planes = oracle_cache(case, via_backend_allocate=False, pool=pool)
        return KVCache.wrap(layout, [in_framework(backend, np.array(p)) for p in planes])
    pk, pv = (inputs.pool_k, inputs.pool_v) if pool is None else pool
    cache = take_cache(layout, backend.allocate(layout), "allocate(layout)")
    meta = fill_meta(layout, spec.block_size)
    plan = backend.plan(meta, spec, layout, num_q_heads=spec.num_kv_heads)
    for layer in range(layout.num_layers):
        cache = take_cache(layout, backend.write_kv(
            plan, cache, key=in_framework(backend, pk[layer]),
            value=in_framework(backend, None if pv is None else pv[layer]), layer=layer,
            **case.scales(layer)), "write_kv")
    return cache


def use_host_planes(layout: Layout) -> bool:
    """Whether the kit builds the planes itself (a dense layout: any framework holds it)."""
    return layout.is_c_contiguous


def to_planes(layout: Layout, cache) -> list[np.ndarray]:
    """A backend's cache as full-buffer numpy planes (checked for count, shape, dtype)."""
    if not isinstance(cache, (list, tuple)) or len(cache) != layout.num_planes:
        n = len(cache) if hasattr(cache, "__len__") else "?"
        raise ConformanceFailure(f"cache: expected a list of {layout.num_planes} planes, got "
                                 f"{type(cache).__name__} of {n}")
    out = full_planes(layout, 0)
    for i, p in enumerate(cache):
        a = np.asarray(to_numpy(p))
        if tuple(a.shape) != plane_shape(layout, i):
            raise ConformanceFailure(f"cache plane {i}: shape {tuple(a.shape)}, the layout "
                                     f"says {plane_shape(layout, i)}")
        try:
            out[i][...] = as_cache_dtype(a, layout.dtype)
        except (TypeError, ValueError) as e:
            raise ConformanceFailure(f"cache plane {i}: dtype {a.dtype} is not the layout's "
                                     f"{layout.dtype}: {e}") from e
    return out


# -- cache comparison -----------------------------------------------------------------------
class StepData:
    """What a step wrote (numpy K/V, slot mapping, layer): lets a cache difference say
    which token's data landed in which slot."""

    def __init__(self, key, value, slot_mapping, layer: int, scales=None):
        self.key, self.value = key, value
        self.slot_mapping = np.asarray(slot_mapping, np.int64)
        self.layer = int(layer)
        self.scales = scales or {}  # the layer's static scales (call keywords)


def _token_bits(x, dt, u, width, spec=None, kv=0, scales=None):
    """[T, H * width] cache-dtype bits of a step's K or V rows (a quantized spec's codes
    under the layer's ``scales``)."""
    from ..backend.reference import to_cache_dtype

    a = np.asarray(x)[..., :width]
    a = stored(spec, a, kv, scales)[0] if spec is not None and spec.is_quantized \
        else to_cache_dtype(a, dt)
    return np.ascontiguousarray(a).view(u).reshape(len(a), -1)


def _attribute(layout, spec, got, want, layer, kv, slot, step, dt, u):
    """Facts about one wrong slot: which token's data it holds and which it should."""
    cache_g, cache_w = _handle(layout, got), _handle(layout, want)
    bs = spec.block_size
    g = cache_g.kv_view(layer, kv)[slot // bs, slot % bs]
    w = cache_w.kv_view(layer, kv)[slot // bs, slot % bs]
    gb, wb = g.view(u), w.view(u)
    bad = np.nonzero((gb != wb).ravel())[0]
    e = int(bad[0]) if len(bad) else 0
    h, d = divmod(e, g.shape[-1])
    facts = {"layer": int(layer), "kv": _kv_name(layout, kv), "slot": int(slot),
             "head": int(h), "element": int(d),
             "got": float(g.reshape(-1)[e].astype(np.float64)),
             "want": float(w.reshape(-1)[e].astype(np.float64))}
    if step is None:
        return facts
    width = g.shape[-1]
    for kvi, (which, arr) in enumerate((("key", step.key), ("value", step.value))):
        if arr is None:
            continue
        wd = min(width, arr.shape[-1])
        try:
            bits = _token_bits(arr, dt, u, wd, spec, kvi, step.scales)
        except KVABIError:  # inputs a quantized write refuses: nothing to attribute
            continue
        row = np.ascontiguousarray(g[..., :wd]).view(u).reshape(-1)
        hit = np.nonzero((bits == row[None, :]).all(axis=1))[0]
        if len(hit):
            t = int(hit[0])
            facts["holds_token"] = t
            facts["holds"] = which
            facts["token_slot"] = int(step.slot_mapping[t]) if t < len(step.slot_mapping) \
                else None
            break
    if layer == step.layer:
        own = np.nonzero(step.slot_mapping == slot)[0]
        if len(own):
            facts["expected_token"] = int(own[0])
    return facts


def _kv_name(layout, kv):
    return "latent" if not layout.has_kv else "KV"[kv]


def _describe(f: dict) -> str:
    s = f"slot {f['slot']} of layer {f['layer']} {f['kv']}"
    if "holds_token" in f:
        t, ts = f["holds_token"], f.get("token_slot")
        where = ("a padding token, slot -1" if ts is not None and ts < 0
                 else f"it belongs in slot {ts}" if ts is not None else "")
        s += f" holds token {t}'s {f['holds']}" + (f" ({where})" if where else "")
    else:
        s += (f" holds a value of no token of the step (head {f['head']} element "
              f"{f['element']}: got {f['got']:.4g}, want {f['want']:.4g})")
    if "expected_token" in f:
        s += f"; it should hold token {f['expected_token']}'s"
    else:
        s += "; it should be unchanged"
    return s


def cache_difference(layout: Layout, spec, got, want, step: StepData | None = None):
    """None when two full-buffer plane lists hold the same bytes, else ``(text,
    details)`` naming the (layer, K/V, slot) entries that differ and, with ``step``, which
    token's data landed in which wrong slot."""
    bad_planes = []
    u = UINT[layout.itemsize]
    for i, (a, b) in enumerate(zip(got, want)):
        if not np.array_equal(raw_items(layout, a), raw_items(layout, b)):
            bad_planes.append(i)
    if not bad_planes:
        return None
    dt = numpy_dtype(spec.dtype)
    cg, cw = _handle(layout, got), _handle(layout, want)
    parts, facts = [], []
    for layer in range(layout.num_layers):
        for kv in (range(2) if layout.has_kv else range(1)):
            a = cg.kv_view(layer, kv).view(u)
            b = cw.kv_view(layer, kv).view(u)
            diff = (a != b).reshape(a.shape[0] * a.shape[1], -1).any(axis=1)
            slots = np.nonzero(diff)[0]
            if len(slots):
                parts.append(f"layer {layer} {_kv_name(layout, kv)}: {len(slots)} slot(s) "
                             f"differ, first {[int(s) for s in slots[:6]]}")
                for s in slots[:16 - min(16, len(facts))]:
                    facts.append(_attribute(layout, spec, got, want, layer, kv, int(s),
                                            step, dt, u))
        for name in (n for n in layout.component_names if n.endswith("_scale")):
            a = np.ascontiguousarray(cg.component_view(name, layer)).view(np.uint8)
            b = np.ascontiguousarray(cw.component_view(name, layer)).view(np.uint8)
            slots = np.nonzero((a != b).reshape(a.shape[0] * a.shape[1], -1).any(axis=1))[0]
            if len(slots):
                parts.append(f"layer {layer} {name}: {len(slots)} slot(s) differ, first "
                             f"{[int(s) for s in slots[:6]]}")
                if not facts:
                    facts.append({"layer": layer, "component": name, "slot": int(slots[0])})
    if not parts:
        text = (f"bytes outside the logical elements (padding) differ in planes "
                f"{bad_planes}")
        return text, {"planes": bad_planes}
    text = "; ".join(parts)
    # A token's data in a wrong slot says the most: those first.
    facts = sorted(facts, key=lambda f: "holds_token" not in f)[:3]
    if facts and "component" not in facts[0]:
        text += ". " + "; ".join(_describe(f) for f in facts if "component" not in f)
    return text, dict(facts[0]) if facts else {}


def expect_same_cache(what: str, layout: Layout, spec, got, want, *, written=None,
                      step: StepData | None = None) -> None:
    """Raise :class:`ConformanceFailure` unless the caches are byte-identical."""
    d = cache_difference(layout, spec, got, want, step)
    if d is not None:
        text, details = d
        if written is not None:
            text += f"; the step writes slots {[int(s) for s in list(written)[:12]]}"
        raise ConformanceFailure(f"{what}: cache bytes differ from the reference: {text}",
                                 details)


# -- one side of a case -----------------------------------------------------------------------
class Runner:
    """One side (backend or reference) of a case: its cache and calls with numpy in/out.

    The cache is built on first use (after the first plan, so that a backend refuses an
    unsupported spec in ``plan`` before it is handed planes of a dtype it never claimed);
    ``pool`` = (pool_k, pool_v) replaces the case's starting cache contents.
    """

    def __init__(self, backend, case: AttentionCase, *, oracle: bool, pool=None):
        self.backend = backend
        self.case = case
        self.oracle = oracle
        self.layout = case.layout
        self.spec = case.spec
        self.pool = pool
        self._cache = None

    @property
    def cache(self) -> KVCache:
        if self._cache is None:
            if self.oracle:
                self._cache = _handle(self.layout, oracle_cache(
                    self.case, pool=self.pool,
                    via_backend_allocate=not use_host_planes(self.layout)))
            else:
                self._cache = backend_cache(self.backend, self.case, self.pool)
        return self._cache

    @cache.setter
    def cache(self, value):
        self._cache = value

    def _x(self, a):
        if a is None:
            return None
        return a if self.oracle else in_framework(self.backend, a)

    def plan(self, meta, spec=None, *, sinks=True, sink_values=None):
        """A plan for ``meta`` and the case's query heads; the case's sinks (when it has
        them and ``sinks``), or ``sink_values``."""
        c = self.case
        s = sink_values
        if s is None and sinks and c.sinks:
            s = c.inputs().sinks
        return self.backend.plan(meta, spec or self.spec, self.layout,
                                 num_q_heads=c.num_q_heads, scale=c.scale, softcap=c.softcap,
                                 sinks=self._x(s))

    def write(self, plan, key, value, layer=None):
        layer = self.case.layer if layer is None else layer
        got = self.backend.write_kv(plan, self.cache, key=self._x(key), value=self._x(value),
                                    layer=layer, **self.case.scales(layer))
        self._cache = take_cache(self.layout, got, "write_kv")

    def attend(self, plan, query, layer=None, *, lse=False, sinks=None, out=False):
        """(out, lse or None) as float64 numpy.

        ``sinks`` (numpy) are passed per call; ``out`` passes a buffer of the output's
        shape in the query's dtype and checks it was written in place (numpy, torch).  The
        output dtype must be the query's and lse float32 (the reference: float64)."""
        layer = self.case.layer if layer is None else layer
        buf = None
        if out:
            q = np.asarray(query)
            dv = self.spec.head_dim_v
            buf = self._x(np.full((q.shape[0], q.shape[1], dv), np.nan, q.dtype))
        got = self.backend.attention(plan, self.cache, query=self._x(query), layer=layer,
                                     sinks=self._x(sinks), out=buf, return_lse=lse,
                                     **self.case.scales(layer))
        if lse:
            if not isinstance(got, tuple) or len(got) != 2:
                raise ConformanceFailure("attention(return_lse=True) must return (out, lse)")
            o, l_ = got
        else:
            if isinstance(got, tuple):
                raise ConformanceFailure("attention(return_lse=False) returned a tuple")
            o, l_ = got, None
        if not self.oracle:
            self._check_dtypes(query, o, l_)
        o_np = self._np(o)
        if buf is not None:
            self._check_in_place(buf, o_np)
        return o_np, (None if l_ is None else self._np(l_))

    def _check_dtypes(self, query, o, l_):
        want = str(np.asarray(query).dtype)
        ok_out = {want} | ({"float64"} if is_reference(self.backend) else set())
        if dtype_str(o) not in ok_out:
            raise ConformanceFailure(
                f"attention output dtype: {dtype_str(o)}, expected the query's {want}",
                {"got_dtype": dtype_str(o), "want_dtype": want})
        ok_lse = {"float32"} | ({"float64"} if is_reference(self.backend) else set())
        if l_ is not None and dtype_str(l_) not in ok_lse:
            raise ConformanceFailure(f"attention lse dtype: {dtype_str(l_)}, expected float32",
                                     {"got_dtype": dtype_str(l_), "want_dtype": "float32"})

    def _check_in_place(self, buf, returned):
        fw = getattr(self.backend, "framework", "numpy")
        if fw not in ("numpy", "torch"):
            return  # jax arrays are immutable: the returned array is the output
        held = self._np(buf)
        rows = slice(0, self.case.meta.num_actual_tokens)
        if not np.array_equal(held[rows], returned[rows], equal_nan=True):
            with np.errstate(invalid="ignore"):
                diff = ~((held[rows] == returned[rows]) |
                         (np.isnan(held[rows]) & np.isnan(returned[rows])))
            t, h, d = (int(x[0]) for x in np.nonzero(diff))
            raise ConformanceFailure(
                f"attention(out=...): the out buffer does not hold the returned output "
                f"(not written in place?): token {t} head {h} element {d}: buffer "
                f"{float(held[t, h, d]):.4g}, returned {float(returned[t, h, d]):.4g}",
                {"token": t, "head": h, "element": d, "got": float(held[t, h, d]),
                 "want": float(returned[t, h, d])})

    def _np(self, x):
        return np.asarray(to_numpy(x)).astype(np.float64)

    def planes(self) -> list[np.ndarray]:
        if self.oracle:
            return list(self.cache)
        return to_planes(self.layout, self.cache)


def step_inputs(case: AttentionCase, rows=None):
    """(key, value, query) of the step, optionally gathered at token ``rows``."""
    i = case.inputs()
    k, v, q = i.key, i.value, i.query
    if rows is not None:
        k, q = k[rows], q[rows]
        v = None if v is None else v[rows]
    return k, v, q


__all__ = ["SENTINEL", "Runner", "StepData", "as_cache_dtype", "backend_cache",
           "cache_difference", "copy_planes", "expect_same_cache", "fill_meta", "fill_pool",
           "full_planes", "in_framework", "input_dtype", "oracle_cache", "plane_shape",
           "put_rows", "raw_items", "step_inputs", "take_cache", "to_planes"]
