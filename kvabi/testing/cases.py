"""One conformance example: a spec, a layout, a batch, attention options, and its arrays.

Hypothesis draws the structure (what shrinks to a readable case); the arrays come from a
numpy generator seeded by the drawn ``seed``.  Every value is exactly representable in the
cache dtype, so writing it is a copy whatever rounding a backend uses, and the backend and
the reference see identical inputs.
"""
from __future__ import annotations

import functools

import attrs
import numpy as np

from ..dtypes import numpy_dtype
from ..layout import Layout
from ..metadata import CommonAttentionMetadata
from ..spec import KVSpec

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
                           self.seed)

    def inputs(self) -> Inputs:
        return self._inputs

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


def make_inputs(spec: KVSpec, layout: Layout, meta: CommonAttentionMetadata, num_q_heads: int,
                sinks: bool, seed: int) -> Inputs:
    """Seeded arrays for a case; see :class:`Inputs`."""
    rng = np.random.default_rng(seed)
    dt = input_dtype(spec.dtype)
    h, d, dv = spec.num_kv_heads, spec.head_dim, spec.head_dim_v
    slots = layout.num_blocks * spec.block_size
    n_l = layout.num_layers
    t = meta.num_tokens

    def vals(shape):
        return exact_values(rng, shape, spec.dtype).astype(dt)

    # MLA: one latent of width D per token; the value is its first Dv entries.
    pool_k = vals((n_l, slots, h, d))
    pool_v = None if spec.is_mla else vals((n_l, slots, h, dv))
    key = vals((t, h, d))
    value = None if spec.is_mla else vals((t, h, dv))
    qstd = QUERY_STD / (INT8_RANGE if spec.dtype == "int8" else 1.0)
    q = rng.standard_normal((t, num_q_heads, d)) * qstd
    query = q.astype(dt)
    sink = (rng.uniform(-2.0, 2.0, num_q_heads).astype(np.float32) if sinks else None)
    return Inputs(pool_k, pool_v, key, value, query, sink)


def step_arrays(case: AttentionCase, salt: int):
    """Another (key, value, query) for ``case``'s step, e.g. for another layer."""
    i = case.inputs()
    rng = np.random.default_rng([case.seed, salt])
    dt = input_dtype(case.spec.dtype)
    key = exact_values(rng, i.key.shape, case.spec.dtype).astype(dt)
    value = None if i.value is None else \
        exact_values(rng, i.value.shape, case.spec.dtype).astype(dt)
    qstd = QUERY_STD / (INT8_RANGE if case.spec.dtype == "int8" else 1.0)
    query = (rng.standard_normal(i.query.shape) * qstd).astype(dt)
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
    return step_arrays(case, 1000 + layer)
