"""One conformance example: a spec, a layout, a batch, attention options, and its arrays.

Hypothesis draws the structure (what shrinks to a readable case); the arrays come from a
numpy generator seeded by the drawn ``seed``.  For a cache of ``quant`` ``none`` every value
is exactly representable in the cache dtype, so writing it is a copy whatever rounding a
backend uses, and the backend and the reference see identical inputs.  A quantized cache
(``specs/semantics.md`` section 11) gets values that need its rounding (every code range,
subnormal codes, saturation), and ``per_tensor`` layers get their own static scales.
"""
from __future__ import annotations

import functools

import attrs
import numpy as np

from ..layout.descriptor import Layout
from ..model.quant import quant_format, quantize_per_tensor, quantize_per_token_head
from ..model.spec import KVSpec
from ..step.metadata import CommonAttentionMetadata
from ..util.dtypes import numpy_dtype

#: standard deviation of query entries; with unit keys and scale 1/sqrt(D) the logits have
#: about this spread, so softmax is neither uniform nor one-hot
QUERY_STD = 2.0
#: int8 caches hold small integers (no quantization scales in the ABI)
INT8_RANGE = 3


def input_dtype(cache_dtype: str) -> np.dtype:
    """dtype of the query/key/value arrays handed to a backend for a cache dtype.

    The cache dtype itself for float32, float16 and bfloat16; float32 (holding values exact
    in the cache dtype) for float8 and int8 caches, whose K/V arrive in a wider dtype.
    """
    if cache_dtype in ("float32", "float16", "bfloat16"):
        return numpy_dtype(cache_dtype)
    return np.dtype(np.float32)


def quant_values(rng: np.random.Generator, shape, spec: KVSpec, scale: float = 1.0
                 ) -> np.ndarray:
    """float32 values for a quantized cache whose dequantized values have about unit size:
    ``per_tensor`` values are ``scale`` times scaled values spread over the codes (about 2%
    saturating, 5% in float8's subnormal range); ``per_token_head`` rows have magnitudes
    between 0.3 and 3 and about one row in 16 is all zero (the scale's epsilon)."""
    qmax = quant_format(spec.dtype).qmax
    if spec.quant == "per_tensor":
        y = rng.standard_normal(shape) * (qmax / 4)
        pick = rng.random(shape)
        y = np.where(pick < 0.02, y * 10, np.where(pick < 0.07, y * 1e-4, y))
        return (y * scale).astype(np.float32)
    rows = rng.uniform(0.3, 3.0, tuple(shape[:-1]) + (1,))
    rows = np.where(rng.random(rows.shape) < 1 / 16, 0.0, rows)
    return (rng.standard_normal(shape) * rows).astype(np.float32)


def layer_scales(spec: KVSpec, seed: int, layer: int) -> dict:
    """The static scales of ``layer`` as ``write_kv``/``attention`` keywords: for a
    ``per_tensor`` spec a float32 ``k_scale`` (and ``v_scale``, not for MLA) about
    ``4 / QMAX`` (generic values, not powers of two), seeded per layer; else {}."""
    if spec.quant != "per_tensor":
        return {}
    qmax = quant_format(spec.dtype).qmax
    ks, vs = np.random.default_rng([seed, 0x5CA1E, layer]).uniform(0.5, 2.0, 2) * 4 / qmax
    out = {"k_scale": float(np.float32(ks))}
    if not spec.is_mla:
        out["v_scale"] = float(np.float32(vs))
    return out


def stored(spec: KVSpec, x, kv: int, scales: dict):
    """What a write stores for rows ``x`` [..., D] of K (``kv`` 0) or V (1): ``(codes,
    row scales)`` in the cache dtype and float32.  ``per_tensor``: codes under the layer's
    ``scales`` (from :func:`layer_scales`), no row scales; ``per_token_head``: codes and
    one scale per row; otherwise the values converted (exact for the kit's values), no row
    scales.  Non-finite entries (the poison of rows no query sees) become the cache dtype's
    NaN or infinity as such and their row's scale NaN: no write stores them, the kit plants
    them in the cache itself."""
    dt = numpy_dtype(spec.dtype)
    x = np.asarray(x)
    if not spec.is_quantized:
        return x.astype(dt), None
    bad = ~np.isfinite(x)
    clean = np.where(bad, 0, x)
    if spec.quant == "per_tensor":
        s = scales["k_scale" if kv == 0 else "v_scale"]
        codes, rows = quantize_per_tensor(clean, s, spec.dtype, spec.rounding), None
    else:
        codes, rows = quantize_per_token_head(clean, spec.dtype, spec.rounding)
    if bad.any():
        with np.errstate(invalid="ignore"):
            codes[bad] = x[bad].astype(dt)
        if rows is not None:
            rows[bad.any(axis=-1)] = np.nan
    return codes, rows


def exact_values(rng: np.random.Generator, shape, cache_dtype: str) -> np.ndarray:
    """float64 values that the cache dtype (and :func:`input_dtype`) hold exactly."""
    if cache_dtype == "int8":
        return rng.integers(-INT8_RANGE, INT8_RANGE + 1, size=shape).astype(np.float64)
    x = rng.standard_normal(shape)
    x = x.astype(numpy_dtype(cache_dtype)).astype(np.float64)
    return x.astype(input_dtype(cache_dtype)).astype(np.float64)


@attrs.frozen
class Inputs:
    """The arrays of a case, numpy, in :func:`input_dtype` (sinks float32).

    ``pool_k``/``pool_v`` [L, num_blocks * block_size, H, D]: what every slot of every layer
    holds before the step (the context already cached).  ``key``/``value`` [T, H, D] and
    ``query`` [T, Hq, D] are the step's; rows of padding tokens hold arbitrary values that
    must never reach the cache.  ``value``/``pool_v`` are None for MLA.
    """

    pool_k: np.ndarray
    pool_v: np.ndarray | None
    key: np.ndarray
    value: np.ndarray | None
    query: np.ndarray
    sinks: np.ndarray | None


@attrs.frozen(eq=False, repr=False)
class AttentionCase:
    """Everything one attention example needs; arrays from :meth:`inputs`."""

    spec: KVSpec
    layout: Layout
    meta: CommonAttentionMetadata
    num_q_heads: int
    scale: float | None = None
    softcap: float | None = None
    sinks: bool = False
    layer: int = 0
    seed: int = 0

    @property
    def num_layers(self) -> int:
        return self.layout.num_layers

    @functools.cached_property
    def _inputs(self) -> Inputs:
        return make_inputs(self.spec, self.layout, self.meta, self.num_q_heads, self.sinks,
                           self.seed, self.layer)

    def inputs(self) -> Inputs:
        return self._inputs

    def scales(self, layer: int | None = None) -> dict:
        """The static scales of ``layer`` (default the case's) as call keywords ({} unless
        the spec is ``per_tensor``): see :func:`layer_scales`."""
        return layer_scales(self.spec, self.seed, self.layer if layer is None else layer)

    def __repr__(self) -> str:
        s, m = self.spec, self.meta
        opts = []
        if s.kind == "sliding_window":
            opts.append(f"window={s.window}")
        if s.kind == "chunked_local":
            opts.append(f"chunk={s.chunk}")
        if s.is_mla:
            opts.append(f"head_dim_v={s.head_dim_v}")
        if s.page_align != 1:
            opts.append(f"page_align={s.page_align}")
        if s.quant != "none":
            opts.append(f"quant={s.quant} rounding={s.rounding}")
        lay = self.layout.name or (f"order={''.join(self.layout.order)} "
                                   f"planes={''.join(self.layout.planes) or '-'}")
        lines = [
            f"AttentionCase({s.kind} {s.dtype} block_size={s.block_size} "
            f"kv_heads={s.num_kv_heads} head_dim={s.head_dim} {' '.join(opts)}".rstrip(),
            f"  layout={lay} num_blocks={self.layout.num_blocks} "
            f"num_layers={self.num_layers} layer={self.layer}",
            f"  q_heads={self.num_q_heads} scale={self.scale} softcap={self.softcap} "
            f"sinks={self.sinks} seed={self.seed}",
            f"  query_lens={m.query_lens.tolist()} context_lens={m.context_lens.tolist()} "
            f"num_tokens={m.num_tokens}",
            f"  block_table={m.block_table.tolist()})",
        ]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle):  # Hypothesis prints failing examples with this
        p.text(repr(self))

    def with_(self, **changes) -> "AttentionCase":
        """A copy with fields replaced (arrays regenerate from the same seed)."""
        return attrs.evolve(self, **changes)


def _query_std(spec: KVSpec) -> float:
    """Query spread: logits of about :data:`QUERY_STD` over the cache's values (int8 caches
    of ``quant`` ``none`` hold integers up to :data:`INT8_RANGE`)."""
    if spec.dtype == "int8" and not spec.is_quantized:
        return QUERY_STD / INT8_RANGE
    return QUERY_STD


def make_inputs(spec: KVSpec, layout: Layout, meta: CommonAttentionMetadata, num_q_heads: int,
                sinks: bool, seed: int, layer: int = 0) -> Inputs:
    """Seeded arrays for a case; see :class:`Inputs` (``layer``: the case's, whose static
    scales its step's key and value are drawn for)."""
    rng = np.random.default_rng(seed)
    dt = input_dtype(spec.dtype)
    h, d, dv = spec.num_kv_heads, spec.head_dim, spec.head_dim_v
    slots = layout.num_blocks * spec.block_size
    n_l = layout.num_layers
    t = meta.num_tokens

    def vals(shape, kv=0, at=layer):
        """Values of ``shape`` for K (``kv`` 0) or V (1) of layer ``at``."""
        if spec.is_quantized:
            scale = layer_scales(spec, seed, at).get(("k_scale", "v_scale")[kv], 1.0)
            return quant_values(rng, shape, spec, scale)
        return exact_values(rng, shape, spec.dtype).astype(dt)

    def pool(width, kv):  # [L, slots, H, width]; quantized: each layer under its scales
        if not spec.is_quantized:
            return vals((n_l, slots, h, width))
        return np.stack([vals((slots, h, width), kv, i) for i in range(n_l)])

    # MLA: one latent of width D per token; the value is its first Dv entries.
    pool_k = pool(d, 0)
    pool_v = None if spec.is_mla else pool(dv, 1)
    key = vals((t, h, d))
    value = None if spec.is_mla else vals((t, h, dv), 1)
    qstd = _query_std(spec)
    q = rng.standard_normal((t, num_q_heads, d)) * qstd
    query = q.astype(dt)
    sink = (rng.uniform(-2.0, 2.0, num_q_heads).astype(np.float32) if sinks else None)
    return Inputs(pool_k, pool_v, key, value, query, sink)


def step_arrays(case: AttentionCase, salt: int, layer: int | None = None):
    """Another (key, value, query) for ``case``'s step, e.g. for another layer (quantized
    values are drawn for ``layer``'s static scales, default the case's)."""
    i = case.inputs()
    spec = case.spec
    rng = np.random.default_rng([case.seed, salt])
    dt = input_dtype(spec.dtype)
    if spec.is_quantized:
        sc = case.scales(layer)
        key = quant_values(rng, i.key.shape, spec, sc.get("k_scale", 1.0))
        value = None if i.value is None else \
            quant_values(rng, i.value.shape, spec, sc.get("v_scale", 1.0))
    else:
        key = exact_values(rng, i.key.shape, spec.dtype).astype(dt)
        value = None if i.value is None else \
            exact_values(rng, i.value.shape, spec.dtype).astype(dt)
    query = (rng.standard_normal(i.query.shape) * _query_std(spec)).astype(dt)
    return key, value, query


def layer_sinks(case: AttentionCase, layer: int) -> np.ndarray:
    """Per-layer attention sinks (float32, one per query head) for ``layer`` of ``case``:
    what a caller passes per call, different for every layer."""
    rng = np.random.default_rng([case.seed, 0x51C, layer])
    return rng.uniform(-2.0, 2.0, case.num_q_heads).astype(np.float32)


def layer_inputs(case: AttentionCase, layer: int):
    """(key, value, query) of ``case``'s step at ``layer``: the case's own arrays at
    ``case.layer``, others seeded per layer (so every layer holds different data)."""
    if layer == case.layer:
        i = case.inputs()
        return i.key, i.value, i.query
    return step_arrays(case, 1000 + layer, layer)
