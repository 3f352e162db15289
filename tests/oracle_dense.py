"""Test support for the transform tests: a dense float64 attention oracle, an attention that
reads keys through a paged cache, and Hypothesis strategies for random batches.

The oracle follows the canonical semantics directly: request r's query i sits at position
``context_lens[r] + i`` and sees the keys of positions j of its own dense history with
j <= p, j > p - W (window W) and j // C == p // C (chunk C).  It never looks at slots or
block tables.  ``paged_attention`` instead reads keys through ``block_table``/``seq_lens``/
``positions`` of (transformed) metadata, so comparing the two checks those arrays.
"""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from kvabi import CommonAttentionMetadata


def _masked_softmax(qry, keys, vals, qpos, kpos, *, window, chunk, scale, softcap):
    """qry [n, Hq, D], keys [m, Hkv, D], vals [m, Hkv, Dv] -> out [n, Hq, Dv], lse [n, Hq]."""
    hq, hkv = qry.shape[1], keys.shape[1]
    g = hq // hkv
    k = np.repeat(keys, g, axis=1)  # query head h reads kv head h // g
    v = np.repeat(vals, g, axis=1)
    logits = np.einsum("nhd,mhd->nhm", qry, k) * scale
    if softcap is not None:
        logits = softcap * np.tanh(logits / softcap)
    p, j = qpos[:, None], kpos[None, :]
    ok = j <= p
    if window is not None:
        ok &= j > p - window
    if chunk is not None:
        ok &= j // chunk == p // chunk
    logits = np.where(ok[:, None, :], logits, -np.inf)
    m = logits.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(logits - m)
    den = w.sum(axis=-1)
    out = np.einsum("nhm,mhd->nhd", w, v) / np.where(den > 0, den, 1.0)[..., None]
    lse = np.where(den > 0, np.log(np.where(den > 0, den, 1.0)) + m[..., 0], -np.inf)
    return out, lse


def dense_attention(meta, k_hist, v_hist, query, *, window=None, chunk=None, scale=None,
                    softcap=None):
    """Oracle over dense histories ``k_hist`` [R, S, Hkv, D] (position-indexed per request).

    Returns ``out`` [T, Hq, Dv] and ``lse`` [T, Hq] in float64; padding rows are 0 / -inf.
    """
    qsl = np.asarray(meta.query_start_loc, np.int64)
    ctx = np.asarray(meta.context_lens, np.int64)
    T, hq, d = query.shape
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    out = np.zeros((T, hq, v_hist.shape[-1]))
    lse = np.full((T, hq), -np.inf)
    for r in range(len(ctx)):
        a, b = qsl[r], qsl[r + 1]
        if a == b:
            continue
        s = ctx[r] + (b - a)
        qpos = ctx[r] + np.arange(b - a)
        out[a:b], lse[a:b] = _masked_softmax(
            query[a:b].astype(np.float64), k_hist[r, :s].astype(np.float64),
            v_hist[r, :s].astype(np.float64), qpos, np.arange(s), window=window,
            chunk=chunk, scale=scale, softcap=softcap)
    return out, lse


def paged_attention(meta, k_cache, v_cache, query, *, window=None, chunk=None, scale=None,
                    softcap=None):
    """Attention reading keys 0..seq_len-1 of each request through ``meta.block_table`` from a
    flat cache [num_slots, Hkv, D], with query positions from ``meta.positions``."""
    qsl = np.asarray(meta.query_start_loc, np.int64)
    T, hq, d = query.shape
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    bs = meta.block_size
    out = np.zeros((T, hq, v_cache.shape[-1]))
    lse = np.full((T, hq), -np.inf)
    for r in range(meta.num_reqs):
        a, b = qsl[r], qsl[r + 1]
        if a == b:
            continue
        j = np.arange(int(meta.seq_lens[r]))
        slots = meta.block_table[r, j // bs].astype(np.int64) * bs + j % bs
        out[a:b], lse[a:b] = _masked_softmax(
            query[a:b].astype(np.float64), k_cache[slots].astype(np.float64),
            v_cache[slots].astype(np.float64), np.asarray(meta.positions[a:b], np.int64), j,
            window=window, chunk=chunk, scale=scale, softcap=softcap)
    return out, lse


def dense_history(meta, cache):
    """Per-request position-indexed history [R, max_seq, ...] gathered from a flat cache via
    ``meta``'s block table (the ground truth the oracle attends over)."""
    bs = meta.block_size
    S = max(meta.max_seq_len, 1)
    hist = np.zeros((meta.num_reqs, S) + cache.shape[1:], cache.dtype)
    for r in range(meta.num_reqs):
        j = np.arange(int(meta.seq_lens[r]))
        hist[r, j] = cache[meta.block_table[r, j // bs].astype(np.int64) * bs + j % bs]
    return hist


def snapshot(meta):
    """Copies of every array of ``meta`` (to check a transform did not mutate it)."""
    return {f: np.array(getattr(meta, f)) for f in
            ("query_start_loc", "seq_lens", "context_lens", "positions", "slot_mapping",
             "block_table")}


def assert_unchanged(meta, snap):
    for f, a in snap.items():
        b = getattr(meta, f)
        assert b.dtype == a.dtype and np.array_equal(b, a), f"{f} was mutated"


# -- strategies --------------------------------------------------------------------------

@st.composite
def batches(draw, *, max_reqs=5, max_query=9, max_context=17, block_sizes=(1, 2, 4),
            shared_prefix_blocks=0, min_reqs=0, min_context=0, padding=True):
    """Random valid metadata: a mix of decodes, chunked and fresh prefills, empty requests,
    trailing padding tokens and distinct (optionally partly shared) block ids."""
    bs = draw(st.sampled_from(block_sizes))
    n = draw(st.integers(min_reqs, max_reqs))
    q = np.array(draw(st.lists(st.integers(0, max_query), min_size=n, max_size=n)), np.int64)
    c = np.array(draw(st.lists(st.integers(min_context, max_context), min_size=n, max_size=n)),
                 np.int64)
    need = -(-(q + c) // bs)
    width = max(int(need.max(initial=0)), shared_prefix_blocks) + draw(st.integers(0, 2))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    pool = shared_prefix_blocks + width * n + draw(st.integers(0, 3))
    ids = rng.permutation(pool)
    bt = np.zeros((n, width), np.int64)
    bt[:, :shared_prefix_blocks] = ids[:shared_prefix_blocks]
    own = ids[shared_prefix_blocks:shared_prefix_blocks + n * width].reshape(n, width)
    bt[:, shared_prefix_blocks:] = own[:, :width - shared_prefix_blocks]
    pad = draw(st.integers(0, 3)) if padding else 0
    return CommonAttentionMetadata.from_lengths(q, c, bt, bs, num_blocks=max(pool, 1),
                                                num_tokens=int(q.sum()) + pad)


@st.composite
def attention_data(draw, meta, *, head_dims=(4,)):
    """(k_cache, v_cache, query) with random GQA head counts; caches are flat by slot."""
    hkv = draw(st.sampled_from([1, 2]))
    g = draw(st.sampled_from([1, 2]))
    d = draw(st.sampled_from(head_dims))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    slots = max(meta.num_blocks or 1, 1) * meta.block_size
    k = rng.standard_normal((slots, hkv, d))
    v = rng.standard_normal((slots, hkv, d))
    qry = rng.standard_normal((meta.num_tokens, hkv * g, d))
    return k, v, qry


def oracle(meta, k_cache, v_cache, query, **kw):
    """Dense oracle over ``meta`` with histories gathered from the caches."""
    return dense_attention(meta, dense_history(meta, k_cache), dense_history(meta, v_cache),
                           query, **kw)
