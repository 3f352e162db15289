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
