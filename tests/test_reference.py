"""The reference backend against a direct, per-token transcription of specs/semantics.md.

The oracle below loops over requests, tokens, query heads and keys in plain Python over the
logical (position-indexed) key history of each request; it never sees slots, block tables
or layouts.  The reference backend instead writes through ``Layout.kv_view`` into paged,
possibly padded and interleaved caches and reads back through the block table, so agreement
checks write_kv, the gather and the vectorized masked softmax together.  ``write_kv`` is also
checked byte for byte against ``Layout.byte_offset`` on every preset layout.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvabi
from kvabi import CommonAttentionMetadata, KVABIError, KVCache, KVSpec
from kvabi.util.dtypes import DTYPES, numpy_dtype
from kvabi.layout.descriptor import Layout
from kvabi.layout.presets import AXIS_PRESETS, preset_names
from kvabi.backend.reference import ReferenceBackend, to_cache_dtype
from kvabi.memory.views import allocate_numpy

BACKEND = ReferenceBackend()
#: the same oracle with tiny query pieces and memory chunks: exercises the batching
SMALL = [ReferenceBackend(query_piece=2, chunk_elements=500),
         ReferenceBackend(query_piece=3, chunk_elements=1)]
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- the oracle: semantics written out, one query token and head at a time ----------------
def visible(spec, p, j, seq_len):
    """Whether the query at absolute position p sees the key at position j."""
    if not (j <= p and j < seq_len):
        return False
    if spec.kind == "sliding_window" and not j > p - spec.window:
        return False
    if spec.kind == "chunked_local" and j // spec.chunk != p // spec.chunk:
        return False
    return True


def oracle(spec, hist_k, hist_v, query, qsl, ctx, *, scale, softcap, sinks):
    """out [T, Hq, Dv], lse [T, Hq] from per-request histories hist_k[r] [s_r, H, D]."""
    t_all, hq, _ = query.shape
    h = spec.num_kv_heads
    group = hq // h
    out = np.zeros((t_all, hq, spec.head_dim_v))
    lse = np.full((t_all, hq), -math.inf)
    for r in range(len(ctx)):
        seq_len = ctx[r] + qsl[r + 1] - qsl[r]
        for i in range(qsl[r + 1] - qsl[r]):
            t, p = qsl[r] + i, ctx[r] + i
            for qh in range(hq):
                kh = qh // group
                logits, values = [], []
                for j in range(seq_len):
                    if not visible(spec, p, j, seq_len):
                        continue
                    x = scale * float(np.dot(query[t, qh], hist_k[r][j, kh]))
                    if softcap is not None:
                        x = softcap * math.tanh(x / softcap)
                    logits.append(x)
                    values.append(hist_v[r][j, kh])
                sink = -math.inf if sinks is None else float(sinks[qh])
                top = max(logits + [sink])
                den = sum(math.exp(x - top) for x in logits) + math.exp(sink - top)
                acc = np.zeros(spec.head_dim_v)
                for x, v in zip(logits, values):
                    acc += math.exp(x - top) * v
                out[t, qh] = acc / den
                lse[t, qh] = top + math.log(den)
    return out, lse


# -- random batches ------------------------------------------------------------------------
@st.composite
def specs(draw, kinds=kvabi.model.spec.KINDS):
    kind = draw(st.sampled_from(kinds))
    dtype = draw(st.sampled_from(DTYPES))
    bs = draw(st.sampled_from([1, 2, 3, 4, 8]))
    extra = {}
    if kind == "sliding_window":
        extra["window"] = draw(st.integers(1, 9))
    if kind == "chunked_local":
        extra["chunk"] = draw(st.integers(1, 9))
    if kind == "mla":
        d = draw(st.integers(2, 10))
        return KVSpec(kind, bs, 1, d, dtype=dtype, head_dim_v=draw(st.integers(1, d)))
    return KVSpec(kind, bs, draw(st.integers(1, 3)), draw(st.integers(1, 9)), dtype=dtype,
                  **extra)


def cache_values(rng, dtype, shape):
    """float64 values exactly representable in the cache dtype."""
    if dtype == "int8":
        return rng.integers(-6, 7, size=shape).astype(np.float64)
    return rng.standard_normal(shape).astype(numpy_dtype(dtype)).astype(np.float64)


def poison(dtype):
    return 77 if dtype == "int8" else np.nan


@st.composite
def batches(draw, kinds=kvabi.model.spec.KINDS):
    """A spec, a preset layout for it, and a step: mixed decodes, prefills, chunked
    prefills and empty requests over shuffled block ids, plus trailing padding tokens."""
    spec = draw(specs(kinds))
    layouts = BACKEND.preferred_layouts(spec)
    name = draw(st.sampled_from(layouts))
    n_req = draw(st.integers(0, 4))
    ctx = np.array(draw(st.lists(st.integers(0, 12), min_size=n_req, max_size=n_req)), int)
    qlen = np.array(draw(st.lists(st.sampled_from([0, 1, 1, 2, 3, 5, 7]), min_size=n_req,
                                  max_size=n_req)), int)
    seq = ctx + qlen
    need = -(-seq // spec.block_size)
    spare = draw(st.integers(0, 3))
    num_blocks = max(1, int(need.sum()) + spare)
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    ids = rng.permutation(num_blocks)
    cols = int(need.max(initial=0)) + draw(st.integers(0, 2))
    # Columns past a request's need hold garbage that must never be read.
    table = rng.choice([-1, 10**6], size=(n_req, cols))
    start = 0
    for r in range(n_req):
        table[r, :need[r]] = ids[start:start + need[r]]
        start += need[r]
    num_layers = draw(st.integers(1, 2))
    layout = Layout.preset(name, spec, num_blocks=num_blocks, num_layers=num_layers)
    layer = draw(st.integers(0, num_layers - 1))
    g = draw(st.sampled_from([1, 2, 3]))
    hq = spec.num_kv_heads * (draw(st.integers(4, 8)) if spec.is_mla else g)
    softcap = draw(st.none() | st.floats(0.5, 20))
    sinks = draw(st.none() | st.just("sinks"))
    scale = draw(st.none() | st.floats(0.05, 2))
    pad = draw(st.integers(0, 3))
    backend = draw(st.sampled_from([BACKEND] + SMALL))
    evict = draw(st.booleans())
    return dict(backend=backend, evict=evict, spec=spec, layout=layout, layer=layer, ctx=ctx, qlen=qlen, table=table,
                num_blocks=num_blocks, hq=hq, softcap=softcap, sinks=sinks, scale=scale,
                pad=pad, rng=rng)


def evict_invisible_blocks(spec, layout, cache, layer, ctx, qlen, table):
    """Poison the blocks no query of the step can see (as an engine recycles the blocks a
    sliding window or chunk left behind): only window and chunk layers have such blocks."""
    if spec.kind not in ("sliding_window", "chunked_local"):
        return
    kview = KVCache.wrap(layout, cache).kv_view(layer, 0)
    vview = KVCache.wrap(layout, cache).kv_view(layer, 1)
    for r in np.nonzero(qlen > 0)[0]:
        lowest = ctx[r] - spec.window + 1 if spec.kind == "sliding_window" else \
            ctx[r] // spec.chunk * spec.chunk
        dead = table[r, :max(0, lowest) // spec.block_size]
        kview[dead] = poison(spec.dtype)
        vview[dead] = poison(spec.dtype)


def run_step(b):
    """Write each request's context in a first (prefill) step, then the new tokens, then
    attend.  Returns everything the checks need."""
    spec, layout, layer, rng = b["spec"], b["layout"], b["layer"], b["rng"]
    backend = b.get("backend", BACKEND)
    ctx, qlen, table = b["ctx"], b["qlen"], b["table"]
    h, d, dv = spec.num_kv_heads, spec.head_dim, spec.head_dim_v
    seq = ctx + qlen
    hist_k = [cache_values(rng, spec.dtype, (s, h, d)) for s in seq]
    # MLA: the latent is the key; attention returns its first head_dim_v elements.
    hist_v = [k[..., :dv] if spec.is_mla else cache_values(rng, spec.dtype, (s, h, dv))
              for s, k in zip(seq, hist_k)]
    cache = KVCache.wrap(layout, allocate_numpy(layout, fill=poison(spec.dtype)))

    def write(meta, rows):
        n = meta.num_tokens
        key = np.full((n, h, d), 1e9)  # padding rows: must never land in the cache
        val = np.full((n, h, dv), 1e9)
        real = meta.num_actual_tokens
        if real:
            key[:real] = np.concatenate([hist_k[r][a:z] for r, (a, z) in enumerate(rows)])
            val[:real] = np.concatenate([hist_v[r][a:z] for r, (a, z) in enumerate(rows)])
        plan = backend.plan(meta, spec, layout, num_q_heads=b["hq"])
        return backend.write_kv(plan, cache, key=key, value=None if spec.is_mla else val,
                                layer=layer)

    pre = CommonAttentionMetadata.from_lengths(ctx, np.zeros_like(ctx), table,
                                               spec.block_size, num_blocks=b["num_blocks"])
    assert write(pre, [(0, c) for c in ctx]) is cache
    meta = CommonAttentionMetadata.from_lengths(qlen, ctx, table, spec.block_size,
                                                num_blocks=b["num_blocks"],
                                                num_tokens=int(qlen.sum()) + b["pad"])
    write(meta, [(c, s) for c, s in zip(ctx, seq)])
    if b.get("evict"):
        evict_invisible_blocks(spec, layout, cache, layer, ctx, qlen, table)
    query = rng.standard_normal((meta.num_tokens, b["hq"], d))
    sinks = rng.uniform(-2, 2, b["hq"]) if b["sinks"] else None
    plan = backend.plan(meta, spec, layout, num_q_heads=b["hq"], scale=b["scale"],
                        softcap=b["softcap"], sinks=sinks)
    out, lse = backend.attention(plan, cache, query=query, layer=layer, return_lse=True)
    scale = 1 / math.sqrt(d) if b["scale"] is None else b["scale"]
    want_out, want_lse = oracle(spec, hist_k, hist_v, query, meta.query_start_loc, ctx,
                                scale=scale, softcap=b["softcap"], sinks=sinks)
    return dict(meta=meta, query=query, cache=cache, plan=plan, out=out, lse=lse,
                want_out=want_out, want_lse=want_lse, hist_k=hist_k, hist_v=hist_v)


# -- attention -----------------------------------------------------------------------------
@settings(max_examples=250, **SETTINGS)
@given(batches())
def test_attention_matches_dense_oracle(b):
    r = run_step(b)
    n = r["meta"].num_tokens
    assert r["out"].shape == (n, b["hq"], b["spec"].head_dim_v)
    assert r["out"].dtype == np.float64 and r["lse"].shape == (n, b["hq"])
    np.testing.assert_allclose(r["out"], r["want_out"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(r["lse"], r["want_lse"], rtol=1e-9, atol=1e-12)
    real = r["meta"].num_actual_tokens
    assert (r["out"][real:] == 0).all() and (r["lse"][real:] == -np.inf).all()
    # Every real token sees at least its own key, so its lse is finite.
    assert np.isfinite(r["lse"][:real]).all()


@settings(max_examples=60, **SETTINGS)
@given(batches(kinds=("full", "sliding_window", "chunked_local")))
def test_last_token_equals_decode_of_it(b):
    """Prefill skip: running only each request's last token (as a decode over the cache the
    full step wrote) gives the full step's result at that token."""
    r = run_step(b)
    meta = r["meta"]
    has = b["qlen"] > 0
    last = meta.query_start_loc[1:][has] - 1
    dmeta = CommonAttentionMetadata.from_lengths(
        has.astype(int)[has], (b["ctx"] + b["qlen"] - 1)[has], b["table"][has],
        b["spec"].block_size, num_blocks=b["num_blocks"])
    plan = BACKEND.plan(dmeta, b["spec"], b["layout"], num_q_heads=b["hq"],
                        scale=r["plan"].scale, softcap=r["plan"].softcap,
                        sinks=r["plan"].sinks)
    out, lse = BACKEND.attention(plan, r["cache"], query=r["query"][last], layer=b["layer"],
                                 return_lse=True)
    np.testing.assert_allclose(out, r["out"][last], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, r["lse"][last], rtol=1e-12, atol=1e-12)


def test_sink_takes_mass_but_adds_no_value():
    """One key with value v and a sink s: out = v * e^x / (e^x + e^s), lse = log(e^x + e^s)."""
    spec = KVSpec("full", 1, 1, 2, dtype="float32")
    layout = Layout.preset("flash_attn", spec, num_blocks=1)
    meta = CommonAttentionMetadata.from_lengths([1], [0], [[0]], 1)
    cache = KVCache.allocate(layout)
    plan = BACKEND.plan(meta, spec, layout, num_q_heads=1, scale=1.0, sinks=[0.5])
    BACKEND.write_kv(plan, cache, key=np.array([[[1.0, 0.0]]]),
                     value=np.array([[[2.0, 4.0]]]))
    out, lse = BACKEND.attention(plan, cache, query=np.array([[[1.5, 7.0]]]), return_lse=True)
    w = math.exp(1.5) / (math.exp(1.5) + math.exp(0.5))
    np.testing.assert_allclose(out[0, 0], [2.0 * w, 4.0 * w], rtol=1e-14)
    np.testing.assert_allclose(lse[0, 0], math.log(math.exp(1.5) + math.exp(0.5)), rtol=1e-14)


def test_long_batch_is_chunked_and_bounded():
    """Many pieces, widths and chunks (forced tiny) do not change results; nor do recycled
    blocks full of NaN outside the window."""
    for backend in SMALL + [BACKEND]:
        b = dict(spec=KVSpec("sliding_window", 4, 2, 8, dtype="float16", window=5),
                 layer=0, ctx=np.array([9, 0, 3, 17]), qlen=np.array([1, 11, 4, 2]),
                 table=np.array([[5, 1, 7, -1, -1], [2, 0, 4, -1, -1], [3, 6, -1, -1, -1],
                                 [8, 9, 10, 11, 12]]),
                 num_blocks=13, hq=4, softcap=None, sinks="sinks", scale=None, pad=2,
                 rng=np.random.default_rng(1), backend=backend, evict=True)
        b["layout"] = Layout.preset("flashinfer.HND", b["spec"], num_blocks=13)
        r = run_step(b)
        np.testing.assert_allclose(r["out"], r["want_out"], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(r["lse"], r["want_lse"], rtol=1e-9, atol=1e-12)
        assert np.isnan(r["cache"][0]).any()  # the eviction did poison something


def test_visible_nan_propagates_invisible_nan_does_not():
    spec = KVSpec("sliding_window", 2, 1, 2, dtype="float32", window=2)
    layout = Layout.preset("flash_attn", spec, num_blocks=2)
    meta = CommonAttentionMetadata.from_lengths([3], [0], [[0, 1]], 2)
    cache = KVCache.allocate(layout)
    plan = BACKEND.plan(meta, spec, layout, num_q_heads=1)
    val = np.ones((3, 1, 2))
    val[0, 0, 1] = np.nan  # position 0: seen by the queries at 0 and 1, not by 2
    BACKEND.write_kv(plan, cache, key=np.ones((3, 1, 2)), value=val)
    out = BACKEND.attention(plan, cache, query=np.ones((3, 1, 2)))
    assert np.isnan(out[0, 0, 1]) and np.isnan(out[1, 0, 1])
    assert np.isfinite(out[:, 0, 0]).all() and out[2, 0, 1] == 1.0


# -- write_kv ------------------------------------------------------------------------------
def raw(plane, layout):
    """The plane's whole buffer (padding included) as flat elements."""
    n = layout.plane_nbytes // layout.itemsize
    # via unsigned ints: numpy's as_strided cannot parse float8_e5m2's typestr
    u = plane.view(np.dtype(f"u{layout.itemsize}"))
    return np.lib.stride_tricks.as_strided(u, (n,), (layout.itemsize,)).view(plane.dtype)


def preset_spec(name, dtype, kind, bs, h, d, dv):
    if name in ("flash_attn", "flashinfer.NHD", "flashinfer.HND", "tpu.combined",
                "tpu.hidden"):
        kind = "full"  # these presets need separate K and V
    if kind == "mla":
        return KVSpec("mla", bs, 1, d, dtype=dtype, head_dim_v=min(dv, d))
    if name == "tpu.combined" and numpy_dtype(dtype).itemsize == 1 and h % 2:
        h += 1  # 4 8-bit values per word must divide the 2H combined heads
    return KVSpec("full", bs, h, d, dtype=dtype)


@pytest.mark.parametrize("name", AXIS_PRESETS)
@settings(max_examples=12, **SETTINGS)
@given(dtype=st.sampled_from(DTYPES), kind=st.sampled_from(["full", "mla"]),
       bs=st.integers(1, 5), h=st.integers(1, 3), d=st.integers(1, 6), dv=st.integers(1, 6),
       layers=st.integers(1, 3), data=st.data())
def test_write_kv_writes_exactly_the_slots(name, dtype, kind, bs, h, d, dv, layers, data):
    """Only the real tokens' slots change, each to its key/value in the cache dtype, at the
    byte offsets the layout defines; padding tokens and every other byte (context slots,
    other layers, alignment padding) keep their poison."""
    spec = preset_spec(name, dtype, kind, bs, h, d, dv)
    n_req = data.draw(st.integers(1, 3))
    ctx = np.array(data.draw(st.lists(st.integers(0, 6), min_size=n_req, max_size=n_req)))
    qlen = np.array(data.draw(st.lists(st.integers(0, 6), min_size=n_req, max_size=n_req)))
    need = -(-(ctx + qlen) // bs)
    num_blocks = max(1, int(need.sum()) + data.draw(st.integers(0, 2)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    ids = rng.permutation(num_blocks)
    table = np.zeros((n_req, max(1, int(need.max()))), int)
    for r in range(n_req):
        table[r, :need[r]] = ids[need[:r].sum():need[:r + 1].sum()]
    meta = CommonAttentionMetadata.from_lengths(
        qlen, ctx, table, bs, num_blocks=num_blocks,
        num_tokens=int(qlen.sum()) + data.draw(st.integers(0, 3)))
    layout = Layout.preset(name, spec, num_blocks=num_blocks, num_layers=layers)
    layer = data.draw(st.integers(0, layers - 1))
    hd, hv, n = spec.num_kv_heads, spec.head_dim_v, meta.num_tokens
    key = cache_values(rng, dtype, (n, hd, spec.head_dim))
    val = cache_values(rng, dtype, (n, hd, hv))
    cache = KVCache.wrap(layout, allocate_numpy(layout, fill=poison(dtype)))
    before = [raw(p, layout).copy() for p in cache]
    plan = BACKEND.plan(meta, spec, layout, num_q_heads=spec.num_kv_heads)
    BACKEND.write_kv(plan, cache, key=key, value=None if spec.is_mla else val, layer=layer)
    # Expected: the poisoned buffers with each real token's elements placed by byte_offset,
    # its slot recomputed here from the block table and positions.
    want = [x.copy() for x in before]
    dt = numpy_dtype(dtype)
    tok = np.arange(meta.num_actual_tokens)
    req = np.repeat(np.arange(n_req), qlen)
    pos = ctx[req] + tok - meta.query_start_loc[req]
    blk = table[req, pos // bs]
    for kv, src, width in ((0, key, spec.head_dim), (1, val, hv)):
        if spec.is_mla and kv == 1:
            continue
        hh, dd = np.meshgrid(np.arange(hd), np.arange(width), indexing="ij")
        plane, off = layout.byte_offset(layer=layer, block=blk[:, None, None], kv=kv,
                                        token=(pos % bs)[:, None, None], head=hh[None],
                                        dim=dd[None])
        plane = np.broadcast_to(plane, (len(tok), hd, width))
        for p in np.unique(plane):
            sel = plane == p
            want[p][off[sel] // layout.itemsize] = src[tok].astype(dt)[sel]
    for p in range(len(cache)):
        assert raw(cache[p], layout).tobytes() == want[p].tobytes(), f"plane {p}"


def test_to_cache_dtype_rounds_and_saturates():
    x = np.array([-300.0, -128.6, -2.5, -0.5, 0.5, 1.5, 2.49, 126.5, 1e9])
    assert to_cache_dtype(x, np.dtype(np.int8)).tolist() == [-128, -128, -2, 0, 0, 2, 2, 126,
                                                             127]
    bf = numpy_dtype("bfloat16")
    # 1 + 2^-8 lies halfway between bfloat16 neighbours 1 and 1 + 2^-7: ties to even.
    assert float(to_cache_dtype(np.array([1 + 2**-8]), bf)[0]) == 1.0
    assert float(to_cache_dtype(np.array([1 + 3 * 2**-8]), bf)[0]) == 1 + 2**-6


# -- errors, capabilities --------------------------------------------------------------------
def _small():
    spec = KVSpec("full", 2, 2, 4, dtype="float32")
    layout = Layout.preset("flashinfer.NHD", spec, num_blocks=3)
    meta = CommonAttentionMetadata.from_lengths([2, 1], [1, 0], [[0, 1], [2, 0]], 2)
    return spec, layout, meta


def test_bad_inputs_raise_kvabi_error_naming_the_field():
    spec, layout, meta = _small()
    cache = KVCache.allocate(layout)
    plan = BACKEND.plan(meta, spec, layout, num_q_heads=2)
    with pytest.raises(KVABIError, match="query"):
        BACKEND.attention(plan, cache, query=np.zeros((3, 3, 4)))  # 3 not multiple of 2
    with pytest.raises(KVABIError, match="query"):
        BACKEND.attention(plan, cache, query=np.zeros((4, 2, 4)))
    with pytest.raises(KVABIError, match="sinks"):
        BACKEND.plan(meta, spec, layout, num_q_heads=4, sinks=[0.0, 1.0])
    with pytest.raises(KVABIError, match="key"):
        BACKEND.write_kv(plan, cache, key=np.zeros((3, 2, 5)), value=np.zeros((3, 2, 4)))
    with pytest.raises(KVABIError, match="value"):
        BACKEND.write_kv(plan, cache, key=np.zeros((3, 2, 4)), value=None)
    with pytest.raises(KVABIError, match="softcap"):
        BACKEND.plan(meta, spec, layout, num_q_heads=2, softcap=0)
    with pytest.raises(KVABIError, match="scale"):
        BACKEND.plan(meta, spec, layout, num_q_heads=2, scale="x")
    with pytest.raises(KVABIError, match="block_table"):
        BACKEND.plan(meta, spec, Layout.preset("flashinfer.NHD", spec, num_blocks=2),
                     num_q_heads=2)
    with pytest.raises(KVABIError, match="dtype"):
        BACKEND.plan(meta, spec, Layout.preset("flashinfer.NHD",
                                               KVSpec("full", 2, 2, 4, dtype="float16"), 3),
                     num_q_heads=2)
    with pytest.raises(KVABIError, match="block_size"):
        BACKEND.plan(meta, KVSpec("full", 4, 2, 4, dtype="float32"), layout, num_q_heads=2)
    with pytest.raises(KVABIError, match="head_dim"):  # the layout's D is 4
        BACKEND.plan(meta, KVSpec("full", 2, 2, 2, dtype="float32"), layout, num_q_heads=2)


def test_plan_is_frozen_with_default_scale():
    spec, layout, meta = _small()
    plan = BACKEND.plan(meta, spec, layout, num_q_heads=2)
    assert isinstance(plan, kvabi.StepPlan) and plan.scale == 0.5
    assert plan.softcap is None and plan.sinks is None and plan.backend == "reference"
    with pytest.raises(AttributeError):
        plan.scale = 1.0


def test_capabilities_and_layouts():
    assert BACKEND.available() == (True, "numpy float64")
    caps = BACKEND.capabilities()
    assert set(caps.kinds) == set(kvabi.model.spec.KINDS) and set(caps.dtypes) == set(DTYPES)
    assert caps.softcap and caps.sinks and caps.head_dims is None and caps.block_sizes is None
    full = KVSpec("full", 16, 8, 128)
    mla = KVSpec("mla", 16, 1, 576, head_dim_v=512)
    assert set(BACKEND.preferred_layouts(full)) == set(preset_names(full))
    got = BACKEND.preferred_layouts(mla)
    assert got and all(not Layout.preset(n, mla, 1).has_kv for n in got)
    for s in (full, mla, KVSpec("sliding_window", 3, 1, 5, dtype="int8", window=2)):
        BACKEND.check_supported(s, softcap=30.0, sinks=True)


# -- KVCache handles, num_q_heads, per-call sinks, out= --------------------------------------
@settings(max_examples=60, **SETTINGS)
@given(batches())
def test_one_plan_serves_every_layer_with_per_layer_sinks(b):
    """One plan (with num_q_heads) for every layer of a KVCache, each layer with its own
    sinks at the call, attended in reverse order: each equals the oracle over that layer's
    history with that layer's sinks (a plan holds no layer-specific state)."""
    spec, layout, rng = b["spec"], b["layout"], b["rng"]
    ctx, qlen, table, hq = b["ctx"], b["qlen"], b["table"], b["hq"]
    h, d, dv = spec.num_kv_heads, spec.head_dim, spec.head_dim_v
    seq = ctx + qlen
    meta = CommonAttentionMetadata.from_lengths(seq, np.zeros_like(seq), table,
                                                spec.block_size, num_blocks=b["num_blocks"])
    cache = kvabi.KVCache.allocate(layout, "numpy", fill=0)
    layers = range(layout.num_layers)
    plan = BACKEND.plan(meta, spec, layout, num_q_heads=hq, scale=b["scale"],
                        softcap=b["softcap"], sinks=rng.uniform(-2, 2, hq))
    hist = []
    for layer in layers:
        hk = [cache_values(rng, spec.dtype, (s, h, d)) for s in seq]
        hv = [k[..., :dv] if spec.is_mla else cache_values(rng, spec.dtype, (s, h, dv))
              for s, k in zip(seq, hk)]
        hist.append((hk, hv))
        key = np.concatenate(hk) if len(hk) else np.zeros((0, h, d))
        val = np.concatenate(hv) if len(hv) else np.zeros((0, h, dv))
        assert BACKEND.write_kv(plan, cache, key=key, value=None if spec.is_mla else val,
                                layer=layer) is cache
    query = rng.standard_normal((meta.num_tokens, hq, d))
    scale = 1 / math.sqrt(d) if b["scale"] is None else b["scale"]
    for layer in reversed(layers):
        sinks = rng.uniform(-2, 2, hq)
        out, lse = BACKEND.attention(plan, cache, query=query, layer=layer, sinks=sinks,
                                     return_lse=True)
        assert out.dtype == np.float64 and lse.dtype == np.float64
        want_out, want_lse = oracle(spec, *hist[layer], query, meta.query_start_loc,
                                    np.zeros_like(seq), scale=scale, softcap=b["softcap"],
                                    sinks=sinks)
        n = meta.num_actual_tokens
        np.testing.assert_allclose(out[:n], want_out[:n], rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(lse[:n], want_lse[:n], rtol=1e-9, atol=1e-12)


def test_out_is_written_in_place_and_returned():
    spec, layout, meta = _small()
    cache = BACKEND.allocate(layout)
    assert isinstance(cache, kvabi.KVCache) and cache.framework == "numpy"
    rng = np.random.default_rng(1)
    plan = BACKEND.plan(meta, spec, layout, num_q_heads=4)
    BACKEND.write_kv(plan, cache, key=rng.standard_normal((3, 2, 4)),
                     value=rng.standard_normal((3, 2, 4)))
    for dt in (np.float32, np.float64):
        q = rng.standard_normal((3, 4, 4)).astype(dt)
        want = BACKEND.attention(plan, cache, query=q)
        out = np.full((3, 4, 4), np.nan, dt)
        got = BACKEND.attention(plan, cache, query=q, out=out)
        assert got is out
        np.testing.assert_allclose(out, want.astype(dt), rtol=1e-6)
    q = q.astype(np.float32)
    got, lse = BACKEND.attention(plan, cache, query=q, out=np.zeros((3, 4, 4), np.float32),
                                 return_lse=True)
    assert got.dtype == np.float32 and lse.shape == (3, 4)
    for bad, match in [(np.zeros((3, 4, 5), np.float32), r"out.shape: must be \[3, 4, 4\]"),
                       (np.zeros((3, 4, 4)), "out.dtype: must be the query's float32"),
                       ([[[0.0]]], "out: must be a numpy array")]:
        with pytest.raises(KVABIError, match=match):
            BACKEND.attention(plan, cache, query=q, out=bad)
    ro = np.zeros((3, 4, 4), np.float32)
    ro.flags.writeable = False
    with pytest.raises(KVABIError, match="out: must be writable"):
        BACKEND.attention(plan, cache, query=q, out=ro)


def test_out_sharing_memory_with_the_query_or_the_cache_is_refused():
    """A kernel writing its output over what it reads would compute from its own output."""
    spec, layout, meta = _small()
    cache = BACKEND.allocate(layout)
    plan = BACKEND.plan(meta, spec, layout, num_q_heads=4)
    q = np.zeros((3, 4, 4), np.float32)
    with pytest.raises(KVABIError, match="out: shares memory with the query"):
        BACKEND.attention(plan, cache, query=q, out=q)
    over = cache[0].reshape(-1)[5:5 + q.size].reshape(q.shape)  # inside layer 0's plane
    with pytest.raises(KVABIError, match="out: shares memory with the cache"):
        BACKEND.attention(plan, cache, query=q, out=over)
    before = cache[0].copy()
    BACKEND.attention(plan, cache, query=q, out=np.zeros_like(q))  # its own memory: fine
    assert np.array_equal(cache[0], before)


def test_num_q_heads_and_call_options_are_checked():
    spec, layout, meta = _small()
    cache = BACKEND.allocate(layout)
    plan = BACKEND.plan(meta, spec, layout, num_q_heads=4)
    with pytest.raises(KVABIError, match="query: the plan was made for num_q_heads=4"):
        BACKEND.attention(plan, cache, query=np.zeros((3, 2, 4)))
    for hq in (3, 0, 4.0, True):
        with pytest.raises(KVABIError, match="num_q_heads"):
            BACKEND.plan(meta, spec, layout, num_q_heads=hq)
    with pytest.raises(KVABIError, match="sinks"):
        BACKEND.plan(meta, spec, layout, num_q_heads=4, sinks=[0.0, 1.0])
    for sinks in ([0.0] * 2, [1j] * 4, ["a"] * 4, [np.nan] * 4, [np.inf] * 4):
        with pytest.raises(KVABIError, match="sinks"):
            BACKEND.attention(plan, cache, query=np.zeros((3, 4, 4)), sinks=sinks)
    for layer in (1, -1, 0.0, True):
        with pytest.raises(KVABIError, match="layer"):
            BACKEND.attention(plan, cache, query=np.zeros((3, 4, 4)), layer=layer)
    with pytest.raises(KVABIError, match="query"):
        BACKEND.attention(plan, cache, query=np.zeros((3, 4, 4), complex))
    with pytest.raises(KVABIError, match="key"):
        BACKEND.write_kv(plan, cache, key=np.zeros((3, 2, 4), complex), value=np.zeros((3, 2, 4)))


def test_caches_are_checked_before_any_write():
    """Only a KVCache of the plan's layout is written: a plain list of planes, and another
    layout's cache, are refused before a byte is written."""
    spec, layout, meta = _small()
    plan = BACKEND.plan(meta, spec, layout, num_q_heads=2)
    k = np.ones((3, 2, 4))
    planes = allocate_numpy(layout)
    with pytest.raises(KVABIError, match="cache: must be a kvabi.KVCache"):
        BACKEND.write_kv(plan, planes, key=k, value=k)
    assert not any(p.any() for p in planes)
    other = KVCache.allocate(Layout.preset("flash_attn", spec, num_blocks=3))
    with pytest.raises(KVABIError, match="cache: its layout"):
        BACKEND.write_kv(plan, other, key=k, value=k)
    with pytest.raises(KVABIError, match="cache: its layout"):
        BACKEND.attention(plan, other, query=k)
    assert not any(p.any() for p in other)
    handle = KVCache.wrap(layout, planes)
    assert BACKEND.write_kv(plan, handle, key=k, value=k) is handle
    assert any(p.any() for p in planes)


def test_a_plan_is_accepted_only_by_the_backend_object_that_made_it():
    """A copy of a plan, a plan rebuilt with other metadata, or another backend object's
    plan would carry arrays nobody checked against the step: refused."""
    import copy

    import attrs

    spec, layout, meta = _small()
    plan = BACKEND.plan(meta, spec, layout, num_q_heads=2)
    cache = BACKEND.allocate(layout)
    k = np.ones((3, 2, 4))
    other_meta = CommonAttentionMetadata.from_lengths([1], [0], [[2]], 2)
    for bad in (copy.copy(plan), attrs.evolve(plan, meta=other_meta),
                ReferenceBackend().plan(meta, spec, layout, num_q_heads=2), "plan"):
        with pytest.raises(KVABIError, match="plan: must come from reference.plan"):
            BACKEND.write_kv(bad, cache, key=k, value=k)
        with pytest.raises(KVABIError, match="plan: must come from reference.plan"):
            BACKEND.attention(bad, cache, query=k)
    assert not any(p.any() for p in cache)


def test_planes_of_the_right_shape_over_too_little_memory_are_refused():
    """A page-aligned layout addresses more bytes than its shape's product: dense planes
    of that shape would be written past their end, so they are refused where they enter
    (issue 10)."""
    spec = KVSpec("full", 4, 2, 6, dtype="float32", page_align=256)
    layout = Layout.preset("flashinfer.NHD", spec, num_blocks=3)
    meta = CommonAttentionMetadata.from_lengths([1], [10], [[0, 1, 2]], 4)
    plan = BACKEND.plan(meta, spec, layout, num_q_heads=2)
    dense = [np.zeros(layout.plane_shape, np.float32) for _ in range(layout.num_planes)]
    with pytest.raises(KVABIError, match="cache"):
        KVCache.wrap(layout, dense)
    good = KVCache.wrap(layout, allocate_numpy(layout))
    BACKEND.write_kv(plan, good, key=np.ones((1, 2, 6)), value=np.ones((1, 2, 6)))
    assert BACKEND.attention(plan, good, query=np.ones((1, 2, 6))).shape == (1, 2, 6)


@settings(max_examples=40, **SETTINGS)
@given(batches())
def test_work_built_per_call_equals_work_kept_in_the_plan(b):
    """Steps too large to keep their chunk work (and masks) in the plan rebuild it per
    call: same results as the oracle."""
    from unittest import mock

    import kvabi.backend.reference_attention as ra

    with mock.patch.object(ra, "WORK_KEEP_ELEMENTS", 0), \
            mock.patch.object(ra, "MASK_KEEP_ELEMENTS", 0):
        r = run_step(b)
        assert r["meta"].num_actual_tokens == 0 or isinstance(
            r["plan"].prepared.work(r["plan"]), ra._PerCall)
    n = r["meta"].num_actual_tokens
    np.testing.assert_allclose(r["out"][:n], r["want_out"][:n], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(r["lse"][:n], r["want_lse"][:n], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kw", [dict(query_piece=True), dict(query_piece=0),
                                dict(chunk_elements=2.0), dict(chunk_elements="8")])
def test_reference_options_are_integers(kw):
    with pytest.raises(KVABIError, match=f"^{next(iter(kw))}: must"):
        ReferenceBackend(**kw)
    assert ReferenceBackend(query_piece=np.int64(4)).query_piece == 4
