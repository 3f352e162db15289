"""KVCache: planes checked against the layout where memory enters, views computed once."""
from __future__ import annotations

import numpy as np
import pytest

import kvabi
from kvabi import KVABIError, KVCache, KVSpec, Layout
from kvabi.memory.views import allocate_numpy

torch = pytest.importorskip("torch")


def _spec(**kw):
    d = dict(kind="full", block_size=4, num_kv_heads=2, head_dim=24, dtype="float32")
    d.update(kw)
    return KVSpec(**d)


PADDED = Layout.preset("flashinfer.HND", _spec(page_align=1024), num_blocks=3)
CROSS = Layout.preset("vllm.BLHNC", _spec(), num_blocks=3, num_layers=2)


def test_allocate_numpy_torch_wrap_and_views_are_the_layouts():
    for fw in ("numpy", "torch"):
        c = KVCache.allocate(CROSS, fw)
        assert isinstance(c, tuple) and c.layout is CROSS and c.framework == fw
        assert KVCache.wrap(CROSS, c) is c
        v = c.kv_view(1, 1)
        assert c.kv_view(1, 1) is v  # cached
        v[2, 3, 1, 5] = 7
        # the element lands at the layout's byte offset (independent path)
        plane, off = CROSS.byte_offset(layer=1, block=2, kv=1, token=3, head=1, dim=5)
        raw = kvabi.tensors.to_numpy(c[plane]) if fw == "torch" else c[plane]
        flat = np.lib.stride_tricks.as_strided(raw, (CROSS.plane_nbytes // 4,), (4,))
        assert flat[off // 4] == 7 and np.count_nonzero(flat) == 1


def test_a_list_of_planes_is_wrapped_over_the_same_memory():
    planes = allocate_numpy(CROSS)
    c = KVCache.wrap(CROSS, planes)
    assert isinstance(c, KVCache) and c[0] is planes[0]


def test_too_little_memory_is_refused_numpy():
    # right shape, C-contiguous: smaller than the page-aligned layout's plane
    assert PADDED.plane_nbytes > int(np.prod(PADDED.plane_shape)) * 4
    with pytest.raises(KVABIError, match=r"cache\[0\]"):
        KVCache.wrap(PADDED, [np.zeros(PADDED.plane_shape, np.float32)])
    # right shape and strides over a buffer that ends too early
    buf = np.zeros(PADDED.plane_nbytes // 4 - 1, np.float32)
    bad = np.lib.stride_tricks.as_strided(
        buf, PADDED.plane_shape, [s * 4 for s in PADDED.plane_strides])
    with pytest.raises(KVABIError, match="memory holds only"):
        KVCache.wrap(PADDED, [bad])
    KVCache.wrap(PADDED, allocate_numpy(PADDED))


def test_too_little_memory_is_refused_torch():
    with pytest.raises(KVABIError, match=r"cache\[0\]"):
        KVCache.wrap(PADDED, [torch.zeros(PADDED.plane_shape)])
    KVCache.wrap(PADDED, KVCache.allocate(PADDED, "torch"))


@pytest.mark.parametrize("bad", ["float16", "shape", "count", "mixed", "object"])
def test_other_dtype_shape_count_framework_refused(bad):
    good = allocate_numpy(CROSS)
    planes = {
        "float16": [np.zeros(CROSS.plane_shape, np.float16)],
        "shape": [np.zeros(CROSS.plane_shape[:-1] + (3,), np.float32)],
        "count": good + good,
        "mixed": None,
        "object": ["not an array"],
    }[bad]
    if bad == "mixed":
        layout = Layout.preset("flash_attn", _spec(), num_blocks=3)
        planes = [allocate_numpy(layout)[0], torch.zeros(layout.plane_shape)]
        with pytest.raises(KVABIError, match="mix frameworks"):
            KVCache.wrap(layout, planes)
        return
    with pytest.raises(KVABIError, match="cache"):
        KVCache.wrap(CROSS, planes)


def test_jax_planes_dense_only():
    jnp = pytest.importorskip("jax.numpy")
    c = KVCache.allocate(CROSS, "jax")
    assert c.framework == "jax"
    with pytest.raises(KVABIError, match="strided views"):
        c.kv_view(0, 0)
    with pytest.raises(KVABIError, match="dense"):
        KVCache.wrap(PADDED, [jnp.zeros(PADDED.plane_shape)])
    new = c.replace_planes({0: c[0] + 1})
    assert new.layout is CROSS and float(new[0][0, 0, 0, 0, 0]) == 1.0


def test_identity_semantics():
    a = KVCache.allocate(CROSS)
    b = KVCache.wrap(CROSS, list(a))
    assert a == a and a != b and len({a, b}) == 2
