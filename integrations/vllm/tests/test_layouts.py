"""vLLM's layout names -> kvabi layouts, checked byte for byte against the views vLLM's own
allocator makes (``create_kv_cache_views``), for all six names and single/multi-layer
tensors; and the choice among a backend's preferred layouts, refusals included."""
import numpy as np
import pytest
import torch

import kvabi
from kvabi import UnsupportedError
from kvabi.util.errors import KVABIError
from kvabi_vllm import layouts as vl
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheLayout, KVCacheTensor,
                                        compute_layout_strides, create_kv_cache_views)

H, BS, D, NB, LAYERS = 2, 4, 8, 5, 3


def vllm_views(name: str):
    """The per-layer views vLLM's allocator makes for ``name`` over one fresh buffer."""
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.float32)
    layout = KVCacheLayout[name]
    strides = compute_layout_strides(spec, NB, LAYERS, layout)  # bytes, [L, B, H, N, C]
    size = sum((n - 1) * s for n, s in zip((LAYERS, NB, H, BS, 2 * D * 4), strides)) + 1
    tensor = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(LAYERS)],
                           layer_stride=strides[0], block_stride=strides[1])
    raw = torch.zeros(size, dtype=torch.int8)
    return raw, create_kv_cache_views(raw, spec, NB, layout, tensor)


def kvspec():
    return kvabi.KVSpec(kind="full", block_size=BS, num_kv_heads=H, head_dim=D,
                        dtype="float32")


@pytest.mark.parametrize("name", vl.VLLM_LAYOUTS)
def test_vllm_preset_is_byte_exact_over_vllms_views(name):
    raw, views = vllm_views(name)
    layout, planes = vl.bind(vl.Choice(name, vl.preset_of(name)), kvspec(), views)
    cache = kvabi.KVCache.wrap(layout, planes)
    base = raw.data_ptr()
    rng = np.random.default_rng(0)
    for _ in range(40):
        l, b, kv, n, h, d = (int(rng.integers(x)) for x in (LAYERS, NB, 2, BS, H, D))
        plane, off = layout.byte_offset(layer=l, block=b, kv=kv, token=n, head=h, dim=d)
        # vLLM's meaning of C: the key's D elements, then the value's.
        want = views[l][b, h, n, kv * D + d].data_ptr() - base
        got = planes[plane].data_ptr() - base + off
        assert got == want, (name, l, b, kv, n, h, d)
    # Writes through kvabi's view land where vLLM's view reads.
    cache.kv_view(2, 1)[3, 1, 0, 5] = 7.0  # [B, N, H, D] of layer 2's values
    assert float(views[2][3, 0, 1, D + 5]) == 7.0


def test_any_order_inside_a_blocks_dense_run_fits():
    """vLLM's CPU kernels read an LBHNC allocation as [B, H, 2, N, D] (keys, then values, of
    each block and head): bytes vLLM gives one block, in another order.  Such a layout fits
    every name whose (block, head) holds one dense run, and not LHBNC (heads outside
    blocks)."""
    tpl = kvabi.Layout(order=("B", "H", "KV", "N", "D"),
                       sizes={"B": 1, "H": H, "KV": 2, "N": BS, "D": D}, dtype="float32")
    assert [n for n in vl.VLLM_LAYOUTS if vl.fits(tpl, n)] == ["LBNHC", "LBHNC", "BLNHC",
                                                                "BLHNC", "BHLNC"]
    head_outside = kvabi.Layout(order=("H", "B", "D", "KV", "N"),
                                sizes={"B": 1, "H": H, "KV": 2, "N": BS, "D": D},
                                dtype="float32")
    assert [n for n in vl.VLLM_LAYOUTS if vl.fits(head_outside, n)] == ["LHBNC"]
    # K and V in separate planes (flash_attn) never fit: vLLM packs them in one tensor.
    assert not any(vl.fits(kvabi.Layout.preset("flash_attn", kvspec(), 1), n)
                   for n in vl.VLLM_LAYOUTS)


class _Fake(kvabi.Backend):
    name = "fake.backend"

    def __init__(self, layouts):
        self._layouts = layouts

    def capabilities(self, spec=None):
        return kvabi.Capabilities(layouts=())

    def preferred_layouts(self, spec):
        return self._layouts


def test_choose_takes_the_first_preferred_layout_that_fits():
    spec = kvspec()
    assert vl.choose(_Fake(("flash_attn", "vllm.BLHNC", "vllm.LBNHC")), spec) == \
        vl.Choice("BLHNC", "vllm.BLHNC")
    assert vl.choose(_Fake(("vllm.BLHNC", "vllm.LBNHC")), spec, vllm_name="LBNHC") == \
        vl.Choice("LBNHC", "vllm.LBNHC")
    # A FlashInfer HND block [2, H, N, D] is the bytes of an LBHNC block in another order
    # (vLLM's own FlashInfer backend reads LBHNC as HND).
    assert vl.choose(_Fake(("flashinfer.HND",)), spec) == vl.Choice("LBHNC", "flashinfer.HND")
    # K and V planes, or head dims padded to 128: no vLLM allocation holds them.
    with pytest.raises(UnsupportedError, match="fake.backend.*flash_attn.*tpu.combined"):
        vl.choose(_Fake(("flash_attn", "tpu.combined")), spec)
    with pytest.raises(KVABIError, match="vllm_layout"):
        vl.choose(_Fake(("vllm.LBHNC",)), spec, vllm_name="NHD")


def test_bind_refuses_views_that_are_not_what_the_name_says():
    raw, views = vllm_views("LBNHC")
    with pytest.raises(KVABIError, match="LBHNC"):
        vl.bind(vl.Choice("LBHNC", "vllm.LBHNC"), kvspec(), views)
    with pytest.raises(KVABIError, match="views"):
        vl.bind(vl.Choice("LBNHC", "vllm.LBNHC"), kvspec(), [])
