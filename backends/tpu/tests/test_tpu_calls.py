"""The calls on both TPU backends: per-call sinks (one plan, one compiled step, different
sinks per layer), ``out=``, ``num_q_heads``, output and lse dtypes, and donated caches
(consumed; the returned cache is right; a consumed cache is refused).  Every result against the reference (numpy float64).  The tests share one spec
and layout so that tpu.pallas (interpreted here) compiles few kernels."""
from __future__ import annotations

import numpy as np
import pytest

from tpu_helpers import (JAX, PALLAS, REFERENCE, TOL, filled_cache, make_spec, rel_l2,
                         to_backend, values)

import kvabi
from kvabi.util.tensors import to_jax, to_numpy
from kvabi import KVABIError
from kvabi_tpu.steps import compiled

BACKENDS = [PALLAS, JAX]
ids = lambda b: b.name  # noqa: E731


def small_step():
    """A 5-token window over 16-token pages, 2 KV heads of 64, float32, two layers."""
    spec = make_spec("sliding_window", 16, 2, 64, "float32", 5)
    meta = kvabi.CommonAttentionMetadata.from_lengths([5, 1, 3], [0, 20, 14],
                                                      [[3, 0], [1, 4], [5, 2]], 16,
                                                      num_blocks=6, num_tokens=10)
    layout = kvabi.Layout.preset("tpu.combined", spec, 6, num_layers=2)
    return spec, meta, layout


def test_abi_version_and_framework():
    for b in BACKENDS:
        assert b.abi_version == kvabi.ABI_VERSION
        assert b.framework == "jax"
        assert isinstance(b.allocate(small_step()[2]), kvabi.KVCache)


@pytest.mark.parametrize("backend", BACKENDS, ids=ids)
def test_per_call_sinks_per_layer_with_one_plan(backend):
    """One plan (with default sinks), two layers with their own sinks: each layer equals
    the reference planned with that layer's sinks, the plan's sinks apply when the call
    gives none, and the second layer's sinks reuse the first layer's compiled step."""
    spec, meta, layout = small_step()
    rng = np.random.default_rng(0)
    planes = filled_cache(layout, spec, rng)
    cache = to_backend(backend, planes)
    q = values(rng, (meta.num_tokens, 4, 64), "float32")
    default = rng.uniform(-2, 2, 4)
    per_layer = [rng.uniform(-2, 2, 4).astype(np.float32), rng.uniform(-2, 2, 4)]
    plan = backend.plan(meta, spec, layout, num_q_heads=4, sinks=default)
    step = compiled("attend", donate=False, cheap=backend._cheap_compile())
    n = meta.num_actual_tokens
    sizes = []
    for layer, sinks in ((0, per_layer[0]), (1, to_jax(per_layer[1])),
                         (1, None)):
        ref_sinks = default if sinks is None else np.asarray(sinks)
        want, want_lse = REFERENCE.attention(
            REFERENCE.plan(meta, spec, layout, num_q_heads=4, sinks=ref_sinks), planes,
            query=q, layer=layer, return_lse=True)
        out, lse = backend.attention(plan, cache, query=to_jax(q), layer=layer, sinks=sinks,
                                     return_lse=True)
        sizes.append(step._cache_size())
        assert rel_l2(to_numpy(out)[:n], want[:n]) <= TOL["float32"]
        assert np.abs(to_numpy(lse)[:n] - want_lse[:n]).max() <= 1e-4
    assert sizes[0] == sizes[1] == sizes[2], f"compiled steps per call: {sizes}"


@pytest.mark.parametrize("backend", BACKENDS, ids=ids)
def test_out_and_dtypes(backend):
    """``out`` is checked, the result returned (jax writes nothing in place); the output
    has the query's dtype (bfloat16 queries over a float32 cache), lse is float32."""
    import jax.numpy as jnp

    spec, meta, layout = small_step()
    rng = np.random.default_rng(1)
    planes = filled_cache(layout, spec, rng)
    cache = to_backend(backend, planes)
    q = values(rng, (meta.num_tokens, 2, 64), "bfloat16")
    plan = backend.plan(meta, spec, layout, num_q_heads=2)
    want = REFERENCE.attention(REFERENCE.plan(meta, spec, layout, num_q_heads=2), planes,
                               query=q.astype(np.float32))
    buf = jnp.zeros((meta.num_tokens, 2, 64), jnp.bfloat16)
    out, lse = backend.attention(plan, cache, query=to_jax(q), out=buf, return_lse=True)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    n = meta.num_actual_tokens
    assert rel_l2(to_numpy(out)[:n], want[:n]) <= TOL["bfloat16"]
    for bad, what in ((jnp.zeros((meta.num_tokens, 2, 64), jnp.float32), "dtype"),
                      (jnp.zeros((meta.num_tokens, 4, 64), jnp.bfloat16), "shape"),
                      (np.zeros(3), "shape")):
        with pytest.raises(KVABIError, match="out"):
            backend.attention(plan, cache, query=to_jax(q), out=bad)


@pytest.mark.parametrize("backend", BACKENDS, ids=ids)
def test_num_q_heads_and_sinks_refusals(backend):
    spec, meta, layout = small_step()
    cache = backend.allocate(layout)
    q2 = to_jax(np.zeros((meta.num_tokens, 2, 64), np.float32))
    plan = backend.plan(meta, spec, layout, num_q_heads=4)
    with pytest.raises(KVABIError, match="num_q_heads=4"):
        backend.attention(plan, cache, query=q2)
    for bad in (3, 0, True, 2.0, "4"):
        with pytest.raises(KVABIError, match="num_q_heads"):
            backend.plan(meta, spec, layout, num_q_heads=bad)
    with pytest.raises(KVABIError, match="sinks"):
        backend.plan(meta, spec, layout, num_q_heads=4, sinks=np.zeros(2))
    plan2 = backend.plan(meta, spec, layout, num_q_heads=2)
    for bad in (np.zeros(3), np.array([0.0, np.nan]), np.zeros(2, complex), ["a", "b"],
                to_jax(np.zeros(3, np.float32)), to_jax(np.array([0.0, np.inf], np.float32))):
        with pytest.raises(KVABIError, match="sinks"):
            backend.attention(plan2, cache, query=q2, sinks=bad)


@pytest.mark.parametrize("backend", BACKENDS, ids=ids)
def test_write_returns_a_kvcache_and_a_plain_list_is_refused(backend):
    spec, meta, layout = small_step()
    rng = np.random.default_rng(2)
    planes = filled_cache(layout, spec, rng)
    k, v = (values(rng, (meta.num_tokens, 2, 64), "float32") for _ in range(2))
    q = values(rng, (meta.num_tokens, 4, 64), "float32")
    sinks = np.array([0.5, -1.0, 1.5, 0.0])
    ref_plan = REFERENCE.plan(meta, spec, layout, num_q_heads=4, sinks=sinks)
    REFERENCE.write_kv(ref_plan, planes, key=k, value=v, layer=1)
    want = REFERENCE.attention(ref_plan, planes, query=q, layer=1)
    plan = backend.plan(meta, spec, layout, num_q_heads=4, sinks=sinks)
    cache = to_backend(backend, filled_cache(layout, spec, np.random.default_rng(2)))
    with pytest.raises(KVABIError, match="cache: must be a kvabi.KVCache"):
        backend.write_kv(plan, list(cache), key=k, value=v, layer=1)
    cache = backend.write_kv(plan, cache, key=k, value=v, layer=1)
    assert type(cache) is kvabi.KVCache
    out = backend.attention(plan, cache, query=to_jax(q), layer=1)
    n = meta.num_actual_tokens
    assert rel_l2(to_numpy(out)[:n], want[:n]) <= TOL["float32"]


@pytest.mark.parametrize("backend", BACKENDS, ids=ids)
def test_donated_cache_is_consumed_and_refused_after(backend):
    """write_kv consumes the planes of the layer it writes; the returned KVCache holds the
    reference's bytes; the consumed handle is refused with a KVABIError, not a crash."""
    spec, meta, layout = small_step()
    rng = np.random.default_rng(3)
    planes = filled_cache(layout, spec, rng)
    k = values(rng, (meta.num_tokens, 2, 64), "float32")
    REFERENCE.write_kv(REFERENCE.plan(meta, spec, layout, num_q_heads=4), planes, key=k,
                       value=k, layer=0)
    old = to_backend(backend, filled_cache(layout, spec, np.random.default_rng(3)))
    plan = backend.plan(meta, spec, layout, num_q_heads=4)
    new = backend.write_kv(plan, old, key=k, value=k, layer=0)
    assert isinstance(new, kvabi.KVCache) and new.layout is layout
    assert old[0].is_deleted() and not old[1].is_deleted() and new[1] is old[1]
    for g, w in zip(new, planes):
        assert np.array_equal(to_numpy(g), w)
    q = to_jax(values(rng, (meta.num_tokens, 4, 64), "float32"))
    sinks = np.zeros(4, np.float32)
    with pytest.raises(KVABIError, match="consumed"):
        backend.attention(plan, old, query=q, layer=0, sinks=sinks)
    with pytest.raises(KVABIError, match="consumed"):
        backend.write_kv(plan, old, key=k, value=k, layer=0)
    backend.attention(plan, old, query=q, layer=1, sinks=sinks)  # layer 1 not donated
