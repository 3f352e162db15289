"""The Triton cache write equals the reference write byte for byte, on every layout."""
import numpy as np
import pytest

import kvabi
from kvabi import UnsupportedError
from kvabi.layout.presets import preset_names
from kvabi.util.tensors import to_numpy

from cuda_testlib import arr, make_step, reference, step_data

TRITON = kvabi.get_backend("cuda.triton")


def _written(backend, step, layer=1):
    """Cache planes after writing the history and the step's K/V (no attention)."""
    spec, layout = step.spec, step.layout()
    kh, vh, k, v, _ = step_data(step)
    cache = backend.allocate(layout)
    for meta, kk, vv in ((step.hist, kh, vh), (step.meta, k, v)):
        if meta.num_tokens:
            p = backend.plan(meta, spec, layout, num_q_heads=step.num_q_heads)
            backend.write_kv(p, cache, key=arr(backend, kk), value=arr(backend, vv),
                             layer=layer)
    return [to_numpy(x) for x in cache]


def _bytes(planes):
    return [np.ascontiguousarray(p).view(np.uint8) for p in planes]


LAYOUTS = preset_names(kvabi.KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_matches_reference_bytes_on_every_layout(layout):
    step = make_step(query_lens=[3, 1, 0], context_lens=[2, 5, 4], layout=layout,
                     dtype="float16", padding=2, seed=7)
    got, want = _written(TRITON, step), _written(reference(), step)
    for g, w in zip(_bytes(got), _bytes(want)):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_write_rounds_like_numpy_and_skips_padding(dtype):
    # float64 inputs round once to the cache dtype (nearest even), as the oracle does;
    # padding slots (-1) are never written, so those bytes stay zero.
    step = make_step(query_lens=[4, 2], context_lens=[0, 3], dtype=dtype, padding=3, seed=3)
    spec, layout = step.spec, step.layout()
    rng = np.random.default_rng(0)
    t = step.meta.num_tokens
    k = rng.normal(size=(t, 2, 8)) * 1e3  # not representable: rounding matters
    v = rng.normal(size=(t, 2, 8))
    planes = {}
    for be in (TRITON, reference()):
        cache = be.allocate(layout)
        p = be.plan(step.meta, spec, layout, num_q_heads=step.num_q_heads)
        be.write_kv(p, cache, key=arr(be, k), value=arr(be, v), layer=0)
        planes[be.name] = _bytes([to_numpy(x) for x in cache])
    for g, w in zip(planes["cuda.triton"], planes["reference"]):
        np.testing.assert_array_equal(g, w)
    # Only the real tokens' K and V bytes can be non-zero.
    written = sum(int(np.count_nonzero(x)) for x in planes["cuda.triton"])
    assert 0 < written <= step.meta.num_actual_tokens * 2 * 2 * 8 * np.dtype(dtype).itemsize


def test_mla_latent_write():
    step = make_step("mla", query_lens=[2, 3], context_lens=[1, 4], layout="vllm.BLNHC",
                     seed=5)
    got, want = _written(TRITON, step), _written(reference(), step)
    for g, w in zip(_bytes(got), _bytes(want)):
        np.testing.assert_array_equal(g, w)


def test_bfloat16_refused_in_interpreter():
    if TRITON.available()[1].startswith("Triton compiled"):
        pytest.skip("compiled mode computes bfloat16")
    step = make_step(query_lens=[1], context_lens=[0], dtype="bfloat16")
    assert "bfloat16" not in TRITON.capabilities(step.spec).dtypes
    with pytest.raises(UnsupportedError, match="bfloat16"):
        TRITON.plan(step.meta, step.spec, step.layout(), num_q_heads=step.num_q_heads)
    # A bf16 key into a float32 cache is refused too, never computed wrongly.
    step32 = make_step(query_lens=[1], context_lens=[0], dtype="float32")
    layout = step32.layout()
    p = TRITON.plan(step32.meta, step32.spec, layout, num_q_heads=step32.num_q_heads)
    import torch

    key = torch.zeros((1, 2, 8), dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="bfloat16"):
        TRITON.write_kv(p, TRITON.allocate(layout), key=key, value=key)
