"""One wording for a layer index outside the layout, from every path that takes one: the
public check, the layout's views and offsets, the cache handle, and the backends installed
here (reference and the worked third-party backend; the TPU backends test theirs)."""
from __future__ import annotations

import numpy as np
import pytest

import kvabi
from kvabi import KVABIError, KVCache

SPEC = kvabi.KVSpec(kind="full", block_size=4, num_kv_heads=1, head_dim=8, dtype="float32")
WANT = r"^layer: {} out of range \[0, 2\)$"


@pytest.mark.parametrize("name", ["flashinfer.HND", "vllm.BLHNC", "tpu.combined"])
@pytest.mark.parametrize("bad", [2, 7, -1])
def test_layout_and_cache_paths(name, bad):
    layout = kvabi.Layout.preset(name, SPEC, num_blocks=4, num_layers=2)
    cache = kvabi.KVCache.allocate(layout)
    for call in (lambda: kvabi.check_layer(bad, layout), lambda: cache.kv_view(bad, 0),
                 lambda: cache.layer_view(bad), lambda: layout.byte_offset(layer=bad),
                 lambda: KVCache.wrap(layout, list(cache)).kv_view(bad, 0)):
        with pytest.raises(KVABIError, match=WANT.format(bad)):
            call()


def test_check_layer_accepts_numpy_ints_and_refuses_other_types():
    layout = kvabi.Layout.preset("flashinfer.HND", SPEC, num_blocks=4, num_layers=2)
    assert kvabi.check_layer(np.int64(1), layout) == 1
    for bad in (True, 1.0, "1", None):
        with pytest.raises(KVABIError, match="^layer: must be an integer"):
            kvabi.check_layer(bad, layout)


@pytest.mark.parametrize("backend_name", ["reference", "example.torch"])
def test_backends(backend_name):
    backend = kvabi.get_backend(backend_name)
    layout = kvabi.Layout.preset(backend.preferred_layouts(SPEC)[0], SPEC, num_blocks=4,
                                 num_layers=2)
    meta = kvabi.CommonAttentionMetadata.from_lengths([2], [0], [[1]], 4, num_blocks=4)
    cache = backend.allocate(layout)
    plan = backend.plan(meta, SPEC, layout, num_q_heads=1)
    kv = kvabi.tensors.convert(np.ones((2, 1, 8), np.float32), backend.framework)
    with pytest.raises(KVABIError, match=WANT.format(2)):
        backend.write_kv(plan, cache, key=kv, value=kv, layer=2)
    with pytest.raises(KVABIError, match=WANT.format(2)):
        backend.attention(plan, cache, query=kv, layer=2)
