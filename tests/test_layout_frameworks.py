"""Layouts address torch and jax memory exactly as numpy's (frameworks installed by make)."""
import numpy as np
import pytest

from kvabi import KVCache, KVSpec, Layout
from kvabi.layout.presets import AXIS_PRESETS
from kvabi.layout.presets_components import CPU

SPEC = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


@pytest.mark.parametrize("name", AXIS_PRESETS + tuple(CPU))
def test_torch_kv_view_writes_the_bytes_byte_offset_names(name):
    torch = pytest.importorskip("torch")
    layout = Layout.preset(name, SPEC, 3, 2)
    planes = [torch.zeros(layout.plane_shape, dtype=torch.float32)
              for _ in range(layout.num_planes)]
    rng = np.random.default_rng(0)
    for layer in range(2):
        for kv in range(2):
            v = KVCache.wrap(layout, planes).kv_view(layer, kv)
            assert v.shape == (3, 4, 2, 8)
            v.copy_(torch.from_numpy(rng.standard_normal(v.shape).astype(np.float32)))
            p, off = layout.byte_offset(layer, 2, kv, 3, 1, 7)
            raw = planes[p].numpy().view(np.uint8).ravel()
            assert raw[off:off + 4].view(np.float32)[0] == v[2, 3, 1, 7].item()
            # the numpy view of the same memory agrees element for element
            nv = KVCache.wrap(layout, [t.numpy() for t in planes]).kv_view(layer, kv)
            np.testing.assert_array_equal(nv, v.numpy())


@pytest.mark.parametrize("name", AXIS_PRESETS)
def test_jax_layer_view_matches_numpy(name):
    jnp = pytest.importorskip("jax.numpy")
    layout = Layout.preset(name, SPEC, 3, 2)
    rng = np.random.default_rng(1)
    planes = [rng.standard_normal(layout.plane_shape).astype(np.float32)
              for _ in range(layout.num_planes)]
    jplanes = [jnp.asarray(p) for p in planes]
    for layer in range(2):
        want = KVCache.wrap(layout, planes).layer_view(layer)
        got = KVCache.wrap(layout, jplanes).layer_view(layer)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), w)
