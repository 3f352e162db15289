"""Shared pieces of the kvabi-tpu tests: small mixed batches, poisoned caches, and the
reference backend (numpy float64) as the oracle every result is compared with."""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

import kvabi
from kvabi import KVCache
from kvabi.util.dtypes import numpy_dtype
from kvabi.memory.views import allocate_numpy

#: a value no written K/V takes (exact in every dtype tested): marks untouched bytes
POISON = -7.75
TOL = {"float32": 1e-5, "bfloat16": 2e-2}

REFERENCE = kvabi.get_backend("reference")
PALLAS = kvabi.get_backend("tpu.pallas")
# Every example has new shapes, so compile time dominates: compile cheaply.
JAX = type(kvabi.get_backend("tpu.jax"))(fast_compile=True)


def make_spec(kind, block_size, heads, head_dim, dtype, span=None):
    kw = {"window": span} if kind == "sliding_window" else \
        {"chunk": span} if kind == "chunked_local" else {}
    return kvabi.KVSpec(kind, block_size=block_size, num_kv_heads=heads, head_dim=head_dim,
                        dtype=dtype, **kw)


@st.composite
def batches(draw, block_size, max_reqs=3, max_query=9, max_context=2, pad=3):
    """Metadata of a mixed batch: decodes, chunked prefills and prefills, zero-query
    requests, trailing padding tokens, shuffled block ids.  Context is up to
    ``max_context`` pages.  The pool size and table width depend only on the arguments, so
    examples share compiled kernels."""
    r = draw(st.integers(1, max_reqs))
    q = np.array(draw(st.lists(st.integers(0, max_query), min_size=r, max_size=r)))
    c = np.array(draw(st.lists(st.integers(0, max_context * block_size), min_size=r,
                               max_size=r)))
    width = -(-(max_query + max_context * block_size) // block_size)
    num_blocks = max_reqs * width + 1
    perm = np.random.default_rng(draw(st.integers(0, 2**16))).permutation(num_blocks)
    table = perm[:r * width].reshape(r, width)
    padding = draw(st.integers(0, pad))
    return kvabi.CommonAttentionMetadata.from_lengths(q, c, table, block_size,
                                                      num_blocks=num_blocks,
                                                      num_tokens=int(q.sum()) + padding)


def values(rng, shape, dtype):
    """Random values exactly representable in ``dtype`` (so a write is a pure copy)."""
    return rng.standard_normal(shape).astype(numpy_dtype(dtype))


def filled_cache(layout, spec, rng):
    """A reference (numpy) KVCache: every byte POISON, then every slot of every layer
    written with random K/V."""
    planes = KVCache.wrap(layout, allocate_numpy(layout, POISON))
    slots = layout.num_blocks * spec.block_size
    shape = (layout.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    for layer in range(layout.num_layers):
        for kv in (0, 1):
            planes.kv_view(layer, kv)[...] = values(
                rng, (slots, spec.num_kv_heads, spec.head_dim), spec.dtype).reshape(shape)
    return planes


def to_backend(backend, cache):
    """Copies of a numpy KVCache's planes as a KVCache in the backend's framework."""
    return cache.replace(tuple(kvabi.tensors.convert(np.array(p), backend.framework)
                               for p in cache))


def same_bytes(a, b) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and \
        np.array_equal(a.view(np.uint8), b.view(np.uint8))


def rel_l2(got, want) -> float:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300))


def cross_layer_layout(spec, num_blocks, num_layers, form):
    """A cross-layer variant of the TPU presets: all layers in one allocation, blocks
    outermost ([B, L, N, ...]), same per-layer form as ``tpu.combined`` / ``tpu.hidden``."""
    base = kvabi.Layout.preset(form, spec, num_blocks)
    sizes = dict(base.sizes, L=num_layers)
    order = ("B", "L") + tuple(a for a in base.order if a != "B")
    planes = tuple(a for a in base.planes if a != "L")
    return kvabi.Layout(order=order, sizes=sizes, dtype=base.dtype, planes=planes,
                        extents=base.extents, folds=base.folds, packing=base.packing,
                        name=f"{form}.cross_layer")


def visible_slots(meta, spec, tokens) -> set[int]:
    """Cache slots the query ``tokens`` may see, straight from the semantics' visibility
    rule (a key j of the token's request with j < seq_len, j <= p, and the window or
    chunk condition): an oracle independent of every backend's masking."""
    qsl, bs = meta.query_start_loc, spec.block_size
    out: set[int] = set()
    for t in tokens:
        r = int(np.searchsorted(qsl, t, side="right")) - 1
        p = int(meta.positions[t])
        j = np.arange(int(meta.seq_lens[r]))
        vis = j <= p
        if spec.kind == "sliding_window":
            vis &= j > p - spec.window
        elif spec.kind == "chunked_local":
            vis &= j // spec.chunk == p // spec.chunk
        j = j[vis]
        out.update((meta.block_table[r, j // bs].astype(np.int64) * bs + j % bs).tolist())
    return out


def poison_invisible(layout, spec, planes, keep: set[int], rng) -> int:
    """Copies of numpy ``planes`` whose K and V rows of every slot not in ``keep`` (every
    layer) hold NaN, +inf or -inf (drawn per row), and whose padding bytes hold NaN; returns
    (planes, number of poisoned slots)."""
    out = KVCache.wrap(layout, allocate_numpy(layout, np.nan))
    slots = layout.num_blocks * spec.block_size
    bad = np.array(sorted(set(range(slots)) - keep), np.int64)
    kinds = np.array([np.nan, np.inf, -np.inf])
    for layer in range(layout.num_layers):
        for kv in (0, 1):
            src = KVCache.wrap(layout, planes).kv_view(layer, kv)
            dst = KVCache.wrap(layout, out).kv_view(layer, kv)
            dst[...] = src
            if len(bad):
                dst[bad // spec.block_size, bad % spec.block_size] = \
                    kinds[rng.integers(0, 3, len(bad))][:, None, None]
    return out, len(bad)
