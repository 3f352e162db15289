"""The compile key of the TPU backends under declared limits (ABI 1.2 ``warmup``).

- Every step within random limits fits its bucket: the counts of the step (tiles, decode
  and prefill tiles, update slices, pages) are counted directly from its lengths and must
  not exceed the bucket's, and the bucket is the smallest rung that holds the step.
- After ``warmup``, mixed random steps within the limits compile nothing (jax's own compile
  event counter and the jitted steps' cache sizes), with and without sinks, and every
  result equals the reference (numpy float64).
- A step beyond the limits is refused, naming the limit.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tpu_helpers import REFERENCE, cross_layer_layout, make_spec, rel_l2

import kvabi
from kvabi import KVABIError, StepLimits
from kvabi_tpu.compile_count import compiles
from kvabi_tpu.env import on_tpu
from kvabi_tpu.jax_backend import JaxBackend
from kvabi_tpu.pallas_backend import PallasBackend
from kvabi_tpu.steps import compiled


@st.composite
def steps_within(draw):
    """(limits, block size, metadata of a step within them: decodes, chunks, fresh
    prefills, zero-query requests, padding tokens)."""
    bs = draw(st.sampled_from([1, 4, 16, 32]))
    lim = StepLimits(max_tokens=draw(st.integers(1, 300)), max_reqs=draw(st.integers(1, 40)),
                     max_seq_len=draw(st.integers(1, 700)))
    r = draw(st.integers(1, lim.max_reqs))
    budget = lim.max_tokens
    q, c = [], []
    for _ in range(r):
        qi = draw(st.integers(0, min(budget, lim.max_seq_len, 80)))
        budget -= qi
        q.append(qi)
        c.append(draw(st.integers(0, lim.max_seq_len - qi)))
    width = -(-lim.max_seq_len // bs)
    table = np.arange(r * width).reshape(r, width)
    pad = draw(st.integers(0, budget))
    meta = kvabi.CommonAttentionMetadata.from_lengths(q, c, table, bs, num_blocks=r * width,
                                                      num_tokens=sum(q) + pad)
    return lim, bs, meta


@settings(max_examples=150, deadline=None)
@given(steps_within(), st.sampled_from([JaxBackend(), PallasBackend()]))
def test_every_step_within_the_limits_fits_its_bucket(case, backend):
    lim, bs, meta = case
    buckets = backend.step_buckets(make_spec("full", bs, 1, 8, "float32"), lim)
    b = buckets.for_step(meta)
    q, seq = meta.query_lens.astype(np.int64), meta.seq_lens.astype(np.int64)
    rows = backend.prefill_rows if hasattr(backend, "prefill_rows") else backend.tile_size
    n_slices = int(kvabi.transforms.kv_update_slices(meta, backend.num_slices_per_block)[1])
    assert meta.num_tokens <= b.tokens and meta.num_reqs <= b.reqs
    assert int(np.ceil(seq / bs).max(initial=0)) <= b.pages
    assert int(np.ceil(q / backend.tile_size).sum()) <= b.tiles
    assert int((q == 1).sum()) <= b.decode_tiles
    assert int(np.ceil(q[q > 1] / rows).sum()) <= b.prefill_tiles
    assert n_slices <= b.slices and b.slices % backend.num_slices_per_block == 0
    # the smallest rung that holds the step
    first = next(r for r in buckets.ladder
                 if r.tokens >= meta.num_tokens and r.reqs >= meta.num_reqs)
    assert b == first
    assert buckets.token_buckets[-1] == lim.max_tokens


def test_ladder_and_refusals():
    spec = make_spec("full", 16, 2, 64, "float32")
    be = JaxBackend()
    lim = StepLimits(max_tokens=100, max_reqs=8, max_seq_len=256)
    assert be.step_buckets(spec, lim).token_buckets == (16, 32, 64, 100)
    assert StepLimits(max_tokens=16, max_reqs=1, max_seq_len=1) is not None
    meta = kvabi.CommonAttentionMetadata.from_lengths([101], [0], [[0] * 16], 16,
                                                      num_blocks=16)
    with pytest.raises(KVABIError, match="num_tokens: 101 exceeds .*max_tokens = 100"):
        be.step_buckets(spec, lim).for_step(meta)
    meta = kvabi.CommonAttentionMetadata.from_lengths([1], [256], [[0] * 17], 16,
                                                      num_blocks=17)
    with pytest.raises(KVABIError, match="seq_lens: 257 exceeds .*max_seq_len = 256"):
        be.step_buckets(spec, lim).for_step(meta)
    with pytest.raises(KVABIError, match="limits: must be a kvabi.StepLimits"):
        be.warmup(spec, kvabi.Layout.preset("tpu.combined", spec, 4), (8, 8, 8))


def mixed_steps(rng, n, lim, bs, num_blocks):
    """``n`` random steps within ``lim``: decodes, chunked and fresh prefills, padding."""
    width = -(-lim.max_seq_len // bs)
    for _ in range(n):
        r = int(rng.integers(1, lim.max_reqs + 1))
        q = np.where(rng.random(r) < 0.5, 1, rng.integers(0, lim.max_tokens // r + 1, r))
        q = np.minimum(q, lim.max_seq_len)
        c = rng.integers(0, lim.max_seq_len - q + 1)
        table = rng.permutation(num_blocks)[:r * width].reshape(r, width)
        pad = int(rng.integers(0, lim.max_tokens - q.sum() + 1))
        yield kvabi.CommonAttentionMetadata.from_lengths(q, c, table, bs,
                                                         num_blocks=num_blocks,
                                                         num_tokens=int(q.sum()) + pad)


def run_after_warmup(backend, spec, layout, lim, hq, steps, rng, layers, uncounted=0):
    """Warm up, then run ``steps`` through ``backend`` and the reference: (compiles during
    the steps after the first ``uncounted``, change of the jitted steps' cache sizes,
    worst relative L2 error)."""
    seen = []
    backend.warmup(spec, layout, lim, num_q_heads=hq,
                   progress=lambda done, total, what: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] == len(seen)
    cache, ref = backend.allocate(layout), REFERENCE.allocate(layout)
    jitted = [compiled(s, donate=d, cheap=backend._cheap_compile())
              for s, d in (("write", backend.donate_cache), ("attend", False))]
    before, sizes = compiles()[0], [f._cache_size() for f in jitted]
    worst = 0.0
    for i, meta in enumerate(steps):
        if i == uncounted:
            before = compiles()[0]
        sinks = rng.uniform(-1, 1, hq) if i % 3 == 0 else None
        plan = backend.plan(meta, spec, layout, num_q_heads=hq)
        rplan = REFERENCE.plan(meta, spec, layout, num_q_heads=hq)
        t = meta.num_tokens
        for layer in layers:
            k, v = rng.standard_normal((2, t, spec.num_kv_heads, spec.head_dim))
            q = rng.standard_normal((t, hq, spec.head_dim)).astype(np.float32)
            k, v = k.astype(np.float32), v.astype(np.float32)
            cache = backend.write_kv(plan, cache, key=k, value=v, layer=layer)
            ref = REFERENCE.write_kv(rplan, ref, key=k, value=v, layer=layer)
            out = backend.attention(plan, cache, query=q, layer=layer, sinks=sinks)
            want = REFERENCE.attention(rplan, ref, query=q, layer=layer, sinks=sinks)
            n = meta.num_actual_tokens
            assert np.asarray(out).shape == (t, hq, spec.head_dim)
            worst = max(worst, rel_l2(np.asarray(out)[:n], want[:n]))
    return compiles()[0] - before, [f._cache_size() - s for f, s in zip(jitted, sizes)], worst


def test_tpu_jax_compiles_nothing_after_warmup():
    """20 mixed steps over a sliding-window spec and a cross-layer layout (whose layer is
    part of the compile key): no compile, results equal to the reference."""
    rng = np.random.default_rng(1)
    spec = make_spec("sliding_window", 8, 2, 32, "float32", 20)
    lim = StepLimits(max_tokens=40, max_reqs=5, max_seq_len=64)
    layout = cross_layer_layout(spec, 48, 2, "tpu.combined")
    steps = list(mixed_steps(rng, 20, lim, 8, 48))
    n, sizes, worst = run_after_warmup(JaxBackend(fast_compile=True), spec, layout, lim, 4,
                                       steps, rng, layers=(0, 1))
    assert (n, sizes) == (0, [0, 0]) and worst < 1e-5


def test_tpu_pallas_compiles_nothing_after_warmup():
    """Interpreted Pallas is slow: one rung (max_tokens 16), a few tiny steps.  The first
    interpreted kernel of a process compiles the simulator's own scalar helpers (a handful
    of eager ops, whatever the shapes; none on a TPU): that step is not counted."""
    rng = np.random.default_rng(2)
    spec = make_spec("full", 8, 1, 32, "float32")
    lim = StepLimits(max_tokens=16, max_reqs=3, max_seq_len=24)
    layout = kvabi.Layout.preset("tpu.combined", spec, 12)
    steps = list(mixed_steps(rng, 4, lim, 8, 12))
    n, sizes, worst = run_after_warmup(PallasBackend(), spec, layout, lim, 2, steps, rng,
                                       layers=(0,), uncounted=0 if on_tpu() else 1)
    assert (n, sizes) == (0, [0, 0]) and worst < 1e-5


def test_beyond_the_limits_is_refused_after_warmup():
    spec = make_spec("full", 8, 1, 32, "float32")
    be = JaxBackend(fast_compile=True)
    layout = kvabi.Layout.preset("tpu.combined", spec, 12)
    be.warmup(spec, layout, StepLimits(max_tokens=16, max_reqs=2, max_seq_len=24))
    meta = kvabi.CommonAttentionMetadata.from_lengths([1, 1, 1], [0, 0, 0],
                                                      [[0], [1], [2]], 8, num_blocks=12)
    with pytest.raises(KVABIError, match="num_reqs: 3 exceeds .*max_reqs = 2"):
        be.plan(meta, spec, layout, num_q_heads=1)
    # another layout (or spec) was not declared: its plans keep the unbounded buckets
    other = kvabi.Layout.preset("tpu.combined", spec, 13)
    assert be.plan(meta, spec, other, num_q_heads=1).prepared.bucket is None
