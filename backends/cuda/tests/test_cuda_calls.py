"""The calls on the three CUDA backends (Triton interpreted, the adapters through their
emulators): ``num_q_heads`` at plan time, per-call sinks with one plan over several
layers, ``out=``, output and lse dtypes.  Every result is compared with kvabi's numpy
float64 reference, planned once per set of sinks, so the oracle does not depend on the
features under test."""
import numpy as np
import pytest
import torch

import kvabi
from kvabi import KVABIError, UnsupportedError
from kvabi.util.tensors import convert

from cuda_testlib import (TOL, arr, compare, fill_layer, host, make_step, reference,
                          reference_layer, run_step)
from emulators import flash_attn_emulator, flashinfer_emulator
from kvabi_cuda.flash_attn_backend import FlashAttnBackend
from kvabi_cuda.flashinfer_backend import FlashInferBackend

TRITON = kvabi.get_backend("cuda.triton")


def _flashinfer():
    return FlashInferBackend(library=flashinfer_emulator, device="cpu")


def _flash_attn():
    return FlashAttnBackend(library=flash_attn_emulator, device="cpu")


BACKENDS = {"triton": lambda: TRITON, "flashinfer": _flashinfer, "flash_attn": _flash_attn}


def _close(step, got, want):
    atol, rtol = TOL[step.spec.dtype]
    np.testing.assert_allclose(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_declares_the_abi_and_torch(name):
    be = BACKENDS[name]()
    assert be.abi_version == kvabi.ABI_VERSION and be.framework == "torch"
    assert be.device().type == "cpu"  # no CUDA device here
    spec = make_step(query_lens=[1], context_lens=[0]).spec
    cache = be.allocate(kvabi.Layout.preset("flash_attn", spec, 2))
    assert isinstance(cache, kvabi.KVCache) and cache.framework == "torch"


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("kind", ["full", "sliding_window", "chunked_local"])
def test_each_kind_equals_the_reference(name, kind):
    step = make_step(kind, window=3, chunk=4, query_lens=[3, 1], context_lens=[5, 6],
                     seed=21)
    compare(step, run_step(BACKENDS[name](), step), run_step(reference(), step))


@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_per_call_sinks_one_plan_over_two_layers(name):
    # A GPT-OSS-like model: one plan per step, each layer its own learned sinks.
    be = BACKENDS[name]()
    step = make_step("sliding_window", window=4, query_lens=[3, 1], context_lens=[4, 6],
                     group=2, seed=31)
    layout = step.layout(num_layers=2)
    cache = be.allocate(layout)
    rng = np.random.default_rng(5)
    sinks = {layer: rng.normal(size=step.num_q_heads) * 2 for layer in (0, 1)}
    queries = {layer: fill_layer(be, step, cache, layout, layer) for layer in (0, 1)}
    plan = be.plan(step.meta, step.spec, layout, num_q_heads=step.num_q_heads)
    a = step.meta.num_actual_tokens
    outs = {}
    for layer in (1, 0, 1):  # any order, repeated
        for s in (sinks[layer], torch.tensor(sinks[layer])):  # numpy and torch sinks
            out, lse = be.attention(plan, cache, query=arr(be, queries[layer]), layer=layer,
                                    sinks=s, return_lse=True)
            want_o, want_l = reference_layer(step, layer, sinks=sinks[layer], layout=layout)
            _close(step, host(out)[:a], want_o)
            _close(step, host(lse)[:a], want_l)
            outs[layer] = host(out)[:a]
    # The sinks matter (the comparison can fail): layer 0 with layer 1's sinks differs.
    wrong, _ = reference_layer(step, 0, sinks=sinks[1], layout=layout)
    assert not np.allclose(outs[0], wrong, atol=1e-3)
    # No per-call sinks: the plan's (none here) apply.
    out = be.attention(plan, cache, query=arr(be, queries[0]), layer=0)
    _close(step, host(out)[:a], reference_layer(step, 0, layout=layout)[0])


def test_per_call_sinks_override_the_plans():
    step = make_step(query_lens=[2, 1], context_lens=[3, 5], group=2, seed=7)
    layout = step.layout()
    cache = TRITON.allocate(layout)
    q = fill_layer(TRITON, step, cache, layout, 1)
    plan_sinks = np.full(step.num_q_heads, 3.0)
    call_sinks = np.linspace(-2, 2, step.num_q_heads)
    plan = TRITON.plan(step.meta, step.spec, layout, sinks=plan_sinks,
                       num_q_heads=step.num_q_heads)
    a = step.meta.num_actual_tokens
    got = host(TRITON.attention(plan, cache, query=arr(TRITON, q), layer=1,
                                sinks=call_sinks))[:a]
    _close(step, got, reference_layer(step, 1, sinks=call_sinks)[0])
    got = host(TRITON.attention(plan, cache, query=arr(TRITON, q), layer=1))[:a]
    _close(step, got, reference_layer(step, 1, sinks=plan_sinks)[0])


@pytest.mark.parametrize("name", ["triton", "flashinfer"])
@pytest.mark.parametrize("bad, match", [(np.zeros(3), "sinks"), (np.array([np.nan] * 4),
                                                                  "sinks"),
                                        (np.zeros((2, 2)), "sinks"), ("abc", "sinks")])
def test_bad_per_call_sinks_refused(name, bad, match):
    be = BACKENDS[name]()
    step = make_step(query_lens=[1], context_lens=[2], group=2, num_kv_heads=2, seed=2)
    layout = step.layout()
    plan = be.plan(step.meta, step.spec, layout, num_q_heads=step.num_q_heads)
    q = arr(be, np.zeros((1, 4, 8), np.float32))
    with pytest.raises(KVABIError, match=match):
        be.attention(plan, be.allocate(layout), query=q, sinks=bad)


def test_flash_attn_refuses_per_call_sinks():
    be = _flash_attn()
    step = make_step(query_lens=[1], context_lens=[2], seed=2)
    layout = step.layout()
    plan = be.plan(step.meta, step.spec, layout, num_q_heads=step.num_q_heads)
    q = arr(be, np.zeros((1, step.num_q_heads, 8), np.float32))
    with pytest.raises(UnsupportedError, match="sinks"):
        be.attention(plan, be.allocate(layout), query=q, sinks=np.zeros(step.num_q_heads))


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_out_is_written_in_place_and_returned(name):
    be = BACKENDS[name]()
    step = make_step(query_lens=[2, 0, 3], context_lens=[4, 2, 1], padding=2, seed=41)
    layout = step.layout()
    cache = be.allocate(layout)
    q = fill_layer(be, step, cache, layout, 1)
    plan = be.plan(step.meta, step.spec, layout, num_q_heads=step.num_q_heads)
    t, a = step.meta.num_tokens, step.meta.num_actual_tokens
    # A strided buffer (every other row of a bigger tensor) filled with garbage.
    big = torch.full((2 * t, step.num_q_heads, step.spec.head_dim_v), float("nan"))
    out = big[::2]
    res, lse = be.attention(plan, cache, query=arr(be, q), layer=1, out=out, return_lse=True)
    assert res is out
    want_o, want_l = reference_layer(step, 1)
    _close(step, host(out)[:a], want_o)
    _close(step, host(lse)[:a], want_l)
    assert torch.isnan(big[1::2]).all()  # nothing outside the view was touched


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_bad_out_refused(name):
    be = BACKENDS[name]()
    step = make_step(query_lens=[2], context_lens=[1], seed=3)
    layout = step.layout()
    plan = be.plan(step.meta, step.spec, layout, num_q_heads=step.num_q_heads)
    q = arr(be, np.zeros((2, step.num_q_heads, 8), np.float32))
    cache = be.allocate(layout)
    for out, match in ((torch.zeros(2, step.num_q_heads, 8, dtype=torch.float16),
                        "out.dtype"), (torch.zeros(3, step.num_q_heads, 8), "out.shape"),
                       (np.zeros((2, step.num_q_heads, 8), np.float32), "out")):
        with pytest.raises(KVABIError, match=match):
            be.attention(plan, cache, query=q, out=out)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_output_in_the_querys_dtype_lse_float32(name):
    # A float16 cache read with a float32 query: the output is float32 (the query's).
    be = BACKENDS[name]()
    step = make_step(query_lens=[2, 1], context_lens=[3, 2], dtype="float16", seed=9)
    layout = step.layout()
    cache = be.allocate(layout)
    q = fill_layer(be, step, cache, layout, 1).astype(np.float32)
    plan = be.plan(step.meta, step.spec, layout, num_q_heads=step.num_q_heads)
    out, lse = be.attention(plan, cache, query=convert(q, "torch"), layer=1, return_lse=True)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    a = step.meta.num_actual_tokens
    _close(step, host(out)[:a], reference_layer(step, 1)[0])
    out16 = be.attention(plan, cache, query=convert(q.astype(np.float16), "torch"), layer=1)
    assert out16.dtype == torch.float16


def test_triton_builds_query_tiles_at_plan_time():
    step = make_step(query_lens=[5, 1], context_lens=[2, 3], group=3, seed=4)
    layout = step.layout()
    plan = TRITON.plan(step.meta, step.spec, layout, num_q_heads=step.num_q_heads)
    steps = plan.prepared
    assert len(steps._tiles) == 1
    (bq, tiles), = steps._tiles.items()
    cache = TRITON.allocate(layout)
    q = fill_layer(TRITON, step, cache, layout, 1)
    out = TRITON.attention(plan, cache, query=arr(TRITON, q), layer=1)
    assert list(steps._tiles) == [bq] and steps._tiles[bq] is tiles  # reused, not rebuilt
    a = step.meta.num_actual_tokens
    _close(step, host(out)[:a], reference_layer(step, 1)[0])


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_num_q_heads_checked(name):
    be = BACKENDS[name]()
    step = make_step(query_lens=[1], context_lens=[2], num_kv_heads=2, group=2, seed=1)
    layout = step.layout()
    for bad, match in ((3, "num_q_heads"), (0, "num_q_heads"), (4.0, "num_q_heads"),
                       (True, "num_q_heads")):
        with pytest.raises(KVABIError, match=match):
            be.plan(step.meta, step.spec, layout, num_q_heads=bad)
    plan = be.plan(step.meta, step.spec, layout, num_q_heads=4)
    q = arr(be, np.zeros((1, 2, 8), np.float32))  # 2 query heads: a valid GQA, not the plan's
    with pytest.raises(KVABIError, match="num_q_heads=4"):
        be.attention(plan, be.allocate(layout), query=q)


class _Spy:
    """The FlashInfer emulator with every wrapper ``plan`` call recorded."""

    def __init__(self):
        self.calls = []
        spy = self

        def wrap(cls):
            class Spied(cls):
                def plan(self, *a, **k):
                    spy.calls.append((cls.__name__, k))
                    return super().plan(*a, **k)

            return Spied

        self.BatchPrefillWithPagedKVCacheWrapper = wrap(
            flashinfer_emulator.BatchPrefillWithPagedKVCacheWrapper)
        self.BatchDecodeWithPagedKVCacheWrapper = wrap(
            flashinfer_emulator.BatchDecodeWithPagedKVCacheWrapper)
        self.append_paged_kv_cache = flashinfer_emulator.append_paged_kv_cache
        self.kvabi_capabilities = flashinfer_emulator.kvabi_capabilities
        self.__name__ = "spied flashinfer emulator"


@pytest.mark.parametrize("query_lens, wrapper", [([1, 1], "Decode"), ([3, 1], "Prefill")])
def test_flashinfer_plans_at_plan_time_with_num_q_heads(query_lens, wrapper):
    spy = _Spy()
    be = FlashInferBackend(library=spy, device="cpu")
    step = make_step("sliding_window", window=3, query_lens=query_lens, context_lens=[4, 2],
                     num_kv_heads=2, group=3, softcap=2.0, seed=8)
    layout = step.layout(num_layers=2)
    cache = be.allocate(layout)
    qs = {layer: fill_layer(be, step, cache, layout, layer) for layer in (0, 1)}
    spy.calls.clear()
    plan = be.plan(step.meta, step.spec, layout, num_q_heads=6, scale=0.25, softcap=2.0)
    assert len(spy.calls) == 1  # FlashInfer's plan ran inside kvabi's plan
    cls, kw = spy.calls[0]
    assert wrapper in cls
    assert kw["num_qo_heads"] == 6 and kw["num_kv_heads"] == 2 and kw["page_size"] == 4
    assert kw["window_left"] == 2 and kw["sm_scale"] == 0.25 and kw["logits_soft_cap"] == 2.0
    assert kw["q_data_type"] == torch.float32
    a = step.meta.num_actual_tokens
    ref = reference()
    for layer in (0, 1):  # every layer reuses it: no further plan call
        out = be.attention(plan, cache, query=arr(be, qs[layer]), layer=layer)
        rc = ref.allocate(layout)
        fill_layer(ref, step, rc, layout, layer)
        rp = ref.plan(step.meta, step.spec, layout, scale=0.25, softcap=2.0,
                      num_q_heads=step.num_q_heads)
        _close(step, host(out)[:a], host(ref.attention(rp, rc, query=qs[layer], layer=layer))[:a])
    assert len(spy.calls) == 1


def _spied_layer_1(query_lens, context_lens, seed):
    """(spy, backend, step, layout, cache, query) with layer 1 of the cache filled through
    a spied FlashInfer emulator, its calls cleared."""
    spy = _Spy()
    be = FlashInferBackend(library=spy, device="cpu")
    step = make_step(query_lens=query_lens, context_lens=context_lens, group=2, seed=seed)
    layout = step.layout()
    cache = be.allocate(layout)
    q = fill_layer(be, step, cache, layout, 1)
    spy.calls.clear()
    return spy, be, step, layout, cache, q


def test_flashinfer_per_call_sinks_on_a_decode_step_use_the_prefill_wrapper():
    # The decode wrapper takes no sinks: per-call sinks plan a prefill wrapper, once.
    spy, be, step, layout, cache, q = _spied_layer_1([1, 1], [5, 2], seed=13)
    plan = be.plan(step.meta, step.spec, layout, num_q_heads=step.num_q_heads)
    sinks = np.linspace(-1, 1, step.num_q_heads)
    a = step.meta.num_actual_tokens
    for _ in range(2):
        out = be.attention(plan, cache, query=arr(be, q), layer=1, sinks=sinks)
        _close(step, host(out)[:a], reference_layer(step, 1, sinks=sinks)[0])
    assert [c for c, _ in spy.calls] == ["BatchDecodeWithPagedKVCacheWrapper",
                                         "BatchPrefillWithPagedKVCacheWrapper"]
