"""KvabiConnector's description of vLLM's cache: the kvabi layouts it derives from vLLM's own
views (built by vLLM's allocator code for each of its six layout names) put every element
where an independent formula says; CPU_ATTN's real cache write is verified against the K/V
layout of key and value components and refutes the single order its name says; bad views give
KVABIError."""
import numpy as np
import pytest
import torch

from kvabi import KVABIError
from kvabi.probe import verify_layout
from kvabi.pd.parts import split_kv
from kvabi_vllm.connector.cache_layouts import (KT_V, KV_PACKED, KV_SPLIT, engine_writer,
                                                group_parts, part_cache)
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheLayout, KVCacheTensor,
                                        compute_layout_strides, create_kv_cache_views)

LAYOUTS = [m.name for m in KVCacheLayout]


def vllm_views(name, *, layers=3, blocks=5, bs=32, heads=2, hd=32, dtype=torch.float32):
    """Per-layer views exactly as vLLM 0.32 makes them for one group."""
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=hd, dtype=dtype)
    layout = KVCacheLayout[name]
    page = spec.page_size_bytes
    block_stride = page * layers if layout.is_block_outermost else None
    ls, bstr, *_ = compute_layout_strides(spec, blocks, layers, layout,
                                          fixed_strides=(None, block_stride, None, None, None))
    size = page * layers * blocks
    raw = torch.zeros(size, dtype=torch.int8)
    t = KVCacheTensor(size=size, layers=[f"l{i}" for i in range(layers)], layer_stride=ls,
                      block_stride=bstr)
    return create_kv_cache_views(raw, spec, blocks, layout, t)


def element_offset(views, interior, layer, block, kv, token, head, dim):
    """Bytes from layer 0's first byte to the element, from the views' own indexing and the
    interior's definition (the formula the connector must agree with)."""
    v = views[layer]
    n, d = v.shape[2], v.shape[3] // 2
    if interior == KV_PACKED:   # [N, 2D]: key then value per token
        idx = (block, head, token, kv * d + dim)
    elif interior == KV_SPLIT:  # [2N, D]: all keys, then all values
        flat = (kv * n + token) * d + dim
        idx = (block, head, flat // (2 * d), flat % (2 * d))
    else:                       # CPU_ATTN: keys [D, N], then values [N, D]
        flat = dim * n + token if kv == 0 else n * d + token * d + dim
        idx = (block, head, flat // (2 * d), flat % (2 * d))
    addr = v[idx].data_ptr()
    return addr - views[0].data_ptr()


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("interior", [KV_PACKED, KV_SPLIT, KT_V])
def test_parts_place_every_element_where_vllm_views_put_it(name, interior):
    views = vllm_views(name)
    if interior != KV_PACKED and name in ("LBNHC", "BLNHC"):
        # heads between a block's tokens: no dense block-head to split
        with pytest.raises(KVABIError, match="not dense"):
            group_parts(views, interior=interior, name=name)
        return
    parts = group_parts(views, interior=interior, name=name)
    assert [p for p, _, _ in parts] == ["kv"]  # CPU_ATTN too: key and value components
    rng = np.random.default_rng(0)
    L, B, H, N, D = 3, 5, 2, 32, 32
    for layer, block, kv, token, head, dim in zip(*(rng.integers(0, m, 400)
                                                  for m in (L, B, 2, N, H, D))):
        want = element_offset(views, interior, int(layer), int(block), int(kv), int(token),
                              int(head), int(dim))
        _, lay, off = parts[0]
        _, got = lay.byte_offset(layer=layer, block=block, kv=kv, token=token, head=head,
                                 dim=dim)
        assert got + off == want, (name, interior, layer, block, kv, token, head, dim)


def test_cross_layer_names_give_block_outermost_layouts():
    for name in ("BLHNC", "BLNHC", "BHLNC"):
        (_, lay, _), = group_parts(vllm_views(name), interior=KV_PACKED)
        assert lay.order[0] == "B"
    (_, lay, _), = group_parts(vllm_views("LBHNC"), interior=KV_PACKED)
    assert lay.order[0] == "L"


class _CpuAttnLayer:
    """What engine_writer needs of a vLLM attention layer: impl.do_kv_cache_update, here
    calling vLLM's compiled CPU cache write directly (ISA vec)."""

    class impl:  # noqa: N801 - mirrors the attribute name vLLM uses
        @staticmethod
        def do_kv_cache_update(layer, key, value, kv_cache, slot_mapping):
            from vllm import _custom_ops as ops

            nb, nh, bs, _ = kv_cache.shape
            k_cache, v_cache = kv_cache.view(nb, nh, 2 * bs, -1).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, "vec")


@pytest.mark.parametrize("name", ["LBHNC", "BLHNC"])
def test_cpu_attn_write_matches_its_component_layout_and_refutes_the_name(name):
    views = vllm_views(name, layers=2, blocks=4)
    layers = [_CpuAttnLayer()] * 2
    parts = [(p, part_cache(views, lay, off)) for p, lay, off in
             group_parts(views, interior=KT_V, name=name)]
    for part, cache in parts:
        verify_layout(cache.layout, list(cache), engine_writer(layers, views, parts, part))
    for wrong in (KV_PACKED, KV_SPLIT):  # what the name says; keys then values untransposed
        (_, lay, off), = group_parts(views, interior=wrong, name=f"{name}.{wrong}")
        one = [("kv", part_cache(views, lay, off))]
        with pytest.raises(KVABIError, match="found .* bytes from where"):
            verify_layout(lay, list(one[0][1]), engine_writer(layers, views, one, "kv"))


def test_bad_views_are_refused_naming_the_field():
    views = vllm_views("LBHNC")
    with pytest.raises(KVABIError, match="kv_caches: vLLM views are"):
        group_parts([views[0][0]])
    with pytest.raises(KVABIError, match="evenly spaced"):
        group_parts([views[0], views[2], views[1]])
    with pytest.raises(KVABIError, match="no layers"):
        group_parts([])
    with pytest.raises(KVABIError, match="interior"):
        group_parts(views, interior="nope")
    odd = torch.zeros(4, 2, 32, 63)
    with pytest.raises(KVABIError, match="content size 63"):
        group_parts([odd])


@pytest.mark.parametrize("name", ["LBHNC", "BLNHC"])
def test_split_kv_holds_the_keys_and_values_of_the_layout(name):
    views = vllm_views(name, layers=2, blocks=3)
    for i, v in enumerate(views):
        v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(i)))
    (_, lay, off), = group_parts(views, interior=KV_PACKED, name=name)
    cache = part_cache(views, lay, off)
    (k, kc), (v, vc) = split_kv(cache)
    assert (k, v) == ("k", "v") and "KV" not in kc.layout.order
    for layer in range(2):
        for kv, part in enumerate((kc, vc)):
            assert torch.equal(part.kv_view(layer, 0), cache.kv_view(layer, kv))


@pytest.mark.parametrize("name", ["LBHNC", "BLHNC", "LHBNC"])
def test_kt_v_halves_place_keys_and_values_where_vllm_views_put_them(name):
    """The axis-form K and V layouts a TP peer reads address each element where CPU_ATTN's
    interior puts it (the independent formula), i.e. the bytes of the kv part's
    components."""
    from kvabi_vllm.connector.cache_layouts import kt_v_halves

    views = vllm_views(name)
    halves = kt_v_halves(views, name=name)
    assert [p for p, _, _ in halves] == ["k", "v"]
    assert all(lay.is_axis_form for _, lay, _ in halves)
    rng = np.random.default_rng(1)
    for layer, block, kv, token, head, dim in zip(*(rng.integers(0, m, 300)
                                                  for m in (3, 5, 2, 32, 2, 32))):
        want = element_offset(views, KT_V, int(layer), int(block), int(kv), int(token),
                              int(head), int(dim))
        _, lay, off = halves[int(kv)]
        _, got = lay.byte_offset(layer=layer, block=block, kv=0, token=token, head=head,
                                 dim=dim)
        assert got + off == want, (name, layer, block, kv, token, head, dim)


def test_with_shard_states_the_ranks_heads_over_the_same_memory():
    from kvabi import KVCache, Shard
    from kvabi.pd import with_shard
    from kvabi_vllm.connector.cache_layouts import tp_shard_info

    views = vllm_views("LBHNC", heads=1)
    (_, lay, off), = group_parts(views, interior=KV_PACKED)
    cache = part_cache(views, lay, off)
    assert with_shard(cache, 0, 1, 1) is cache  # TP 1: unchanged
    got = with_shard(cache, 1, 2, 2)
    assert isinstance(got, KVCache) and got.layout.shard == Shard.tp(1, 2, 2)
    assert got[0].data_ptr() == cache[0].data_ptr()
    assert got.layout.fingerprint() != cache.layout.fingerprint()
    with pytest.raises(KVABIError, match="rank 0 of 2 holds 1 KV heads, the split of 4 "
                                         "gives it 2"):
        with_shard(cache, 0, 2, 4)
    with pytest.raises(KVABIError, match="ranks: 3 KV heads cannot be split evenly over 2"):
        with_shard(cache, 0, 2, 3)

    class _Model:
        def get_total_num_kv_heads(self):
            return 8

    class _Config:
        model_config = _Model()
    assert tp_shard_info(_Config()) == (0, 1, 8)  # no TP group in this process
