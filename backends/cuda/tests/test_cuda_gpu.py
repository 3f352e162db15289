"""The real kernels on a CUDA device against the reference backend (skipped without one).

The conformance kit's gpu-marked classes (test_cuda_conformance.py) cover the ABI; these add
the shapes the libraries actually serve (head dim 64/128, flash-attn's 256-token pages,
bfloat16, compiled Triton) over Hypothesis steps.
"""
import pytest
from hypothesis import HealthCheck, given, settings

import kvabi

from cuda_testlib import compare, make_step, reference, run_step, steps

pytestmark = pytest.mark.gpu
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _backend(name):
    be = kvabi.get_backend(name)
    ok, why = be.available()
    if not ok:
        pytest.skip(f"{name} unavailable: {why}")
    return be


@SETTINGS
@given(steps(dtypes=("float32", "float16", "bfloat16"), head_dims=(16, 64, 128),
             block_sizes=(1, 16, 32), max_ctx=200, max_q=70, group_max=4,
             kinds=("full", "sliding_window", "chunked_local", "mla"),
             layouts=("flash_attn", "flashinfer.HND", "vllm.BLNHC")))
def test_triton_compiled_matches_reference(step):
    from kvabi_cuda.runtime import triton_mode

    be = _backend("cuda.triton")
    if triton_mode()[0] != "compiled":
        pytest.skip("Triton runs interpreted here, not compiled")
    if step.spec.is_mla and step.layout_name in ("flash_attn", "flashinfer.HND"):
        step = make_step("mla", query_lens=step.meta.query_lens, layout="vllm.BLNHC",
                         context_lens=step.meta.context_lens, seed=step.seed)
    compare(step, run_step(be, step), run_step(reference(), step))


@SETTINGS
@given(steps(dtypes=("float16", "bfloat16"), head_dims=(64, 128), block_sizes=(16,),
             max_ctx=100, max_q=40, group_max=4,
             layouts=("flashinfer.NHD", "flashinfer.HND", "vllm.LBHNC")))
def test_flashinfer_matches_reference(step):
    be = _backend("cuda.flashinfer")
    if step.sinks is not None and not be.capabilities(step.spec).sinks:
        step = make_step(step.spec.kind, query_lens=step.meta.query_lens,
                         context_lens=step.meta.context_lens, seed=step.seed,
                         dtype=step.spec.dtype, head_dim=64, block_size=16,
                         window=step.spec.window, chunk=step.spec.chunk)
    compare(step, run_step(be, step), run_step(reference(), step))


@SETTINGS
@given(steps(dtypes=("float16", "bfloat16"), head_dims=(64, 128), block_sizes=(256,),
             max_ctx=600, max_q=40, group_max=4, allow_sinks=False,
             kinds=("full", "sliding_window"), layouts=("flash_attn", "flashinfer.NHD")))
def test_flash_attn_matches_reference(step):
    be = _backend("cuda.flash_attn")
    compare(step, run_step(be, step), run_step(reference(), step))


# -- ABI 1.1 and hostile-input paths of the real kernels ----------------------------------

def _one_plan_two_layers(be, step, *, per_call_sinks: bool, poison: bool):
    """One plan (num_q_heads at plan time) over two layers, per-call sinks, out= into a
    strided buffer, optionally NaN/inf in every row no query may see; compared with the
    reference on clean data."""
    import numpy as np
    import torch

    from cuda_testlib import TOL, arr, fill_layer, host, reference_layer, visible_slots
    from test_cuda_hostile import _poison

    layout = step.layout(num_layers=2)
    cache = be.allocate(layout)
    qs = {layer: fill_layer(be, step, cache, layout, layer) for layer in (0, 1)}
    if poison:
        dirty = np.nonzero(~visible_slots(step))[0]
        for layer in (0, 1):
            _poison(cache, layer, dirty, step.spec.block_size, step.spec.is_mla, seed=layer)
    plan = be.plan(step.meta, step.spec, layout, num_q_heads=step.num_q_heads,
                   softcap=step.softcap)
    rng = np.random.default_rng(0)
    a, t = step.meta.num_actual_tokens, step.meta.num_tokens
    atol, rtol = TOL[step.spec.dtype]
    for layer in (1, 0):
        sinks = rng.normal(size=step.num_q_heads) if per_call_sinks else None
        q = arr(be, qs[layer])
        big = torch.full((2 * t, step.num_q_heads, step.spec.head_dim_v), float("nan"),
                         dtype=q.dtype, device=q.device)
        out, lse = be.attention(plan, cache, query=q, layer=layer, sinks=sinks, out=big[::2], return_lse=True)
        assert out.data_ptr() == big.data_ptr() and lse.dtype == torch.float32
        want_o, want_l = reference_layer(step, layer, sinks=sinks, layout=layout)
        np.testing.assert_allclose(host(out)[:a], want_o, atol=atol, rtol=rtol)
        np.testing.assert_allclose(host(lse)[:a], want_l, atol=atol, rtol=rtol)


@pytest.mark.parametrize("idx64", [False, True])
@pytest.mark.parametrize("kind", ["full", "sliding_window", "chunked_local"])
def test_triton_compiled_1_1_and_poison(kind, idx64, monkeypatch):
    from kvabi_cuda import triton_backend
    from kvabi_cuda.runtime import triton_mode

    be = _backend("cuda.triton")
    if triton_mode()[0] != "compiled":
        pytest.skip("Triton runs interpreted here, not compiled")
    if idx64:
        monkeypatch.setattr(triton_backend, "needs_int64", lambda *a, **k: True)
    step = make_step(kind, window=5, chunk=32, query_lens=[40, 1, 7], context_lens=[50, 90, 3],
                     block_size=16, head_dim=64, group=4, dtype="float16", seed=3)
    _one_plan_two_layers(be, step, per_call_sinks=True, poison=True)


def test_triton_compiled_nonfinite_value_reaches_only_the_rows_that_see_it():
    from kvabi_cuda.runtime import triton_mode

    _backend("cuda.triton")
    if triton_mode()[0] != "compiled":
        pytest.skip("Triton runs interpreted here, not compiled")
    from test_cuda_hostile import test_triton_nonfinite_value_reaches_only_the_rows_that_see_it

    for kind in ("sliding_window", "chunked_local", "full"):
        test_triton_nonfinite_value_reaches_only_the_rows_that_see_it(kind)


@pytest.mark.parametrize("kind", ["full", "sliding_window"])
def test_flashinfer_real_1_1(kind):
    be = _backend("cuda.flashinfer")
    step = make_step(kind, window=20, query_lens=[1, 1, 1], context_lens=[70, 5, 33],
                     block_size=16, head_dim=128, group=4, dtype="float16", seed=5)
    _one_plan_two_layers(be, step, per_call_sinks=be.capabilities(step.spec).sinks,
                         poison=False)


def test_flash_attn_real_1_1():
    be = _backend("cuda.flash_attn")
    step = make_step(query_lens=[3, 1], context_lens=[300, 20], block_size=256, head_dim=64,
                     group=2, dtype="bfloat16", seed=6)
    _one_plan_two_layers(be, step, per_call_sinks=False, poison=False)
