"""The Triton paged attention equals the float64 oracle (kvabi's reference backend).

In interpret mode each launch costs a fraction of a second, so examples are few and small;
the fixed cases pin the features (window, chunk, soft cap, sinks, GQA, MLA, layouts) that
Hypothesis might not reach in that budget.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import kvabi

from cuda_testlib import arr, compare, host, make_step, mismatch, reference, run_step, steps

TRITON = kvabi.get_backend("cuda.triton")
SETTINGS = settings(max_examples=16, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(steps(dtypes=("float32", "float16"),
             layouts=("flash_attn", "flashinfer.NHD", "flashinfer.HND", "vllm.BLNHC")))
def test_matches_reference(step):
    compare(step, run_step(TRITON, step), run_step(reference(), step))


CASES = {
    "window_decode_and_prefill": dict(kind="sliding_window", window=3,
                                      query_lens=[1, 5, 2], context_lens=[9, 2, 6]),
    "window_1_sees_only_itself": dict(kind="sliding_window", window=1,
                                      query_lens=[3], context_lens=[4]),
    "chunk_crossing": dict(kind="chunked_local", chunk=4, query_lens=[6, 1],
                           context_lens=[3, 8]),
    "gqa_4_softcap_sinks": dict(group=4, softcap=1.5, sinks=True, query_lens=[2, 3],
                                context_lens=[7, 0]),
    "mla": dict(kind="mla", query_lens=[2, 1], context_lens=[5, 3], layout="vllm.LBNHC",
                group=3),
    "cross_layer_hnd": dict(layout="vllm.BHLNC", query_lens=[4], context_lens=[5],
                            dtype="float16"),
    "padding_and_empty_request": dict(query_lens=[0, 3, 0], context_lens=[5, 1, 0],
                                      padding=3),
    "long_prefill_many_tiles": dict(query_lens=[70, 1], context_lens=[30, 12],
                                    block_size=8, group=2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_feature_cases(name):
    step = make_step(seed=11, **CASES[name])
    compare(step, run_step(TRITON, step), run_step(reference(), step))


def test_scale_is_honoured():
    step = make_step(query_lens=[3], context_lens=[4], seed=2)
    got = run_step(TRITON, step, scale=0.05)
    compare(step, got, run_step(reference(), step, scale=0.05))
    with pytest.raises(AssertionError):  # and a different scale gives a different answer
        compare(step, got, run_step(reference(), step))


def test_comparison_can_fail():
    # The harness is not vacuous: a window of W+1 differs from W on a step that reaches
    # past the window.
    a = make_step("sliding_window", window=3, query_lens=[4], context_lens=[6], seed=4)
    b = make_step("sliding_window", window=4, query_lens=[4], context_lens=[6], seed=4)
    with pytest.raises(AssertionError):
        compare(a, run_step(TRITON, a), run_step(reference(), b))
    assert not mismatch(a, TRITON)


def test_layers_are_independent():
    # Layer 1 written, layer 0 left zero: attention over layer 0 sees zero keys/values
    # (output 0, lse log(#visible keys)), so the kernel indexes the right layer.
    step = make_step(query_lens=[2], context_lens=[3], layout="vllm.LBHNC", seed=9)
    o, l, _ = run_step(TRITON, step, layer=1)
    layout = step.layout()
    cache = TRITON.allocate(layout)
    p = TRITON.plan(step.meta, step.spec, layout, num_q_heads=step.num_q_heads)
    q = arr(TRITON, np.ones((step.meta.num_tokens, step.num_q_heads, 8)))
    o0, l0 = TRITON.attention(p, cache, query=q, layer=0, return_lse=True)
    np.testing.assert_allclose(host(o0)[:2], 0.0)
    np.testing.assert_allclose(host(l0)[:2], np.log([[4.0] * 4, [5.0] * 4]),
                               rtol=1e-6)
    assert np.abs(o).max() > 0


def _d_outer_layout(spec, num_blocks, num_layers):
    # D outside N and H, and padded heads: nothing is contiguous along D.
    return kvabi.Layout(order=("B", "KV", "D", "N", "H"), planes=("L",),
                        sizes={"L": num_layers, "B": num_blocks, "KV": 2,
                               "N": spec.block_size, "H": spec.num_kv_heads,
                               "D": spec.head_dim},
                        extents={"H": spec.num_kv_heads + 1}, dtype=spec.dtype)


def test_any_strides_even_d_not_contiguous():
    step = make_step("sliding_window", window=4, query_lens=[3, 1], context_lens=[5, 6],
                     layout=_d_outer_layout, dtype="float16", seed=8)
    k = TRITON.allocate(step.layout()).kv_view(0, 0)
    assert k.stride(3) != 1
    got, want = run_step(TRITON, step), run_step(reference(), step)
    compare(step, got, want)
    for g, w in zip(got[2], want[2]):  # and the cache bytes, padding included
        np.testing.assert_array_equal(np.ascontiguousarray(g).view(np.uint8),
                                      np.ascontiguousarray(w).view(np.uint8))
