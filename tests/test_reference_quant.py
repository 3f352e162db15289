"""The reference on quantized caches against direct formulas: the codes a per-tensor write
stores (ml_dtypes' conversion of the float32 recipe written out here), attention over them
as a dense float64 softmax of codes times scales, and refusals by field."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import kvabi
from kvabi import KVABIError, KVSpec, Layout
from oracle_dense import dense_attention

CODES = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}
QMAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0, "int8": 127.0}


def written(dtype, x, s):
    """Codes of x under static scale s, nearest-even: fl32(x * fl32(1/s)), saturated."""
    y = (np.asarray(x, np.float32) * (np.float32(1) / np.float32(s))).astype(np.float32)
    if dtype == "int8":
        return np.clip(np.round(y.astype(np.float64)), -128, 127).astype(np.int8)
    return np.clip(y, -QMAX[dtype], QMAX[dtype]).astype(CODES[dtype])


def step(spec, rng, ctx=(5, 0), q=(1, 6)):
    bs = spec.block_size
    table = np.arange(8).reshape(2, 4)
    return kvabi.CommonAttentionMetadata.from_lengths(list(q), list(ctx), table, bs,
                                                      num_blocks=8)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "int8"])
@pytest.mark.parametrize("kind", ["full", "sliding_window"])
def test_per_tensor_write_and_attention(dtype, kind):
    rng = np.random.default_rng(7)
    spec = KVSpec(kind, 4, 2, 8, dtype=dtype, quant="per_tensor",
                  window=3 if kind == "sliding_window" else None)
    layout = Layout.preset("flashinfer.HND", spec, num_blocks=8, num_layers=2)
    ref = kvabi.get_backend("reference")
    ks, vs = 0.013, 0.021  # generic values: not powers of two
    ks32, vs32 = float(np.float32(ks)), float(np.float32(vs))
    # the whole history, written in two steps; values span the codes and saturate
    hist = [rng.standard_normal((s, 2, 8)).astype(np.float32) * QMAX[dtype] * ks32 / 3
            for s in (6, 6)]
    vhist = [rng.standard_normal((s, 2, 8)).astype(np.float32) * QMAX[dtype] * vs32 / 3
             for s in (6, 6)]
    hist[0][0, 0, 0] = 1e4  # saturates
    cache = ref.allocate(layout)
    meta0 = step(spec, rng, ctx=(0, 0), q=(5, 0))
    plan0 = ref.plan(meta0, spec, layout, num_q_heads=4)
    ref.write_kv(plan0, cache, key=hist[0][:5], value=vhist[0][:5], layer=1, k_scale=ks,
                 v_scale=vs)
    meta = step(spec, rng)
    key = np.concatenate([hist[0][5:6], hist[1][:6]])
    val = np.concatenate([vhist[0][5:6], vhist[1][:6]])
    plan = ref.plan(meta, spec, layout, num_q_heads=4)
    ref.write_kv(plan, cache, key=key, value=val, layer=1, k_scale=ks, v_scale=vs)
    kview, vview = cache.kv_view(1, 0), cache.kv_view(1, 1)
    # request 0: blocks 0, 1 (positions 0..5); request 1: blocks 4, 5 (positions 0..5)
    kc = [np.concatenate([kview[0], kview[1]])[:6], np.concatenate([kview[4], kview[5]])[:6]]
    vc = [np.concatenate([vview[0], vview[1]])[:6], np.concatenate([vview[4], vview[5]])[:6]]
    for r in range(2):
        want_k = written(dtype, hist[r], ks)
        np.testing.assert_array_equal(kc[r].view(np.uint8), want_k.view(np.uint8))
        np.testing.assert_array_equal(vc[r].view(np.uint8),
                                      written(dtype, vhist[r], vs).view(np.uint8))
    assert np.abs(kc[0][0, 0, 0].astype(np.float64)) == QMAX[dtype] if dtype != "int8" \
        else kc[0][0, 0, 0] == 127
    # the other layer is untouched
    assert not np.asarray(cache.kv_view(0, 0)).view(np.uint8).any()

    query = rng.standard_normal((meta.num_tokens, 4, 8))
    out, lse = ref.attention(plan, cache, query=query, layer=1, return_lse=True,
                             k_scale=ks, v_scale=vs)
    kd = np.stack([c.astype(np.float64) * ks32 for c in kc])
    vd = np.stack([c.astype(np.float64) * vs32 for c in vc])
    want, want_lse = dense_attention(meta, kd, vd, query,
                                     window=spec.window if kind == "sliding_window" else None)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    # the scales matter: read with another scale, the output moves
    other = ref.attention(plan, cache, query=query, layer=1, k_scale=ks, v_scale=2 * vs)
    np.testing.assert_allclose(other, 2 * out, rtol=1e-12, atol=1e-12)


def test_mla_per_tensor_uses_k_scale():
    spec = KVSpec("mla", 4, 1, 8, dtype="float8_e4m3fn", head_dim_v=6, quant="per_tensor")
    layout = Layout.preset("vllm.LBHNC", spec, num_blocks=2)
    ref = kvabi.get_backend("reference")
    meta = kvabi.CommonAttentionMetadata.from_lengths([3], [0], [[1]], 4, num_blocks=2)
    plan = ref.plan(meta, spec, layout, num_q_heads=2)
    lat = np.random.default_rng(0).standard_normal((3, 1, 8)).astype(np.float32)
    cache = ref.write_kv(plan, ref.allocate(layout), key=lat, k_scale=0.01)
    np.testing.assert_array_equal(cache.kv_view(0, 0)[1, :3].view(np.uint8),
                                  written("float8_e4m3fn", lat, 0.01).view(np.uint8))
    with pytest.raises(KVABIError, match="^v_scale:"):
        ref.attention(plan, cache, query=np.zeros((3, 2, 8)), k_scale=0.01, v_scale=0.5)


def test_scales_refused_by_field_and_cache_unchanged():
    ref = kvabi.get_backend("reference")
    plain = KVSpec("full", 4, 1, 8, dtype="float8_e4m3fn")
    quant = KVSpec("full", 4, 1, 8, dtype="float8_e4m3fn", quant="per_tensor")
    meta = kvabi.CommonAttentionMetadata.from_lengths([2], [0], [[0]], 4, num_blocks=1)
    k = np.ones((2, 1, 8), np.float32)
    lay = Layout.preset("vllm.LBHNC", plain, num_blocks=1)
    with pytest.raises(KVABIError, match="^k_scale: static scales are for a per_tensor"):
        ref.write_kv(ref.plan(meta, plain, lay, num_q_heads=1), ref.allocate(lay), key=k,
                     value=k, k_scale=0.5)
    lay = Layout.preset("vllm.LBHNC", quant, num_blocks=1)
    plan = ref.plan(meta, quant, lay, num_q_heads=1)
    cache = ref.allocate(lay)
    for bad in (0.0, -1.0, float("nan"), float("inf"), "0.5"):
        with pytest.raises(KVABIError, match="^v_scale:"):
            ref.write_kv(plan, cache, key=k, value=k, v_scale=bad)
    bad_v = k.copy()
    bad_v[1, 0, 3] = np.inf
    with pytest.raises(KVABIError, match=r"^value: .*\(1, 0, 3\)"):
        ref.write_kv(plan, cache, key=k, value=bad_v)
    assert not cache.planes[0].view(np.uint8).any()  # nothing written by a refused call


def packed_layout(spec, num_blocks):
    """vLLM's per-token-head cache for one layer, stated by components from its definition:
    ``[B, H, N, 2 * (D + 4)]`` bytes, per (block, head, token) ``[K | K scale (float32) | V
    | V scale]`` (``triton_attn.py``, ``_ensure_scale_caches``)."""
    d, h, n = spec.head_dim, spec.num_kv_heads, spec.block_size
    rec = 2 * (d + 4)
    st = {"B": h * n * rec, "H": n * rec, "N": rec}
    comps = [kvabi.Component(name="key", dtype=spec.dtype, count=d, strides={**st, "E": 1}),
             kvabi.Component(name="key_scale", dtype="float32", count=1, offset=d,
                             strides=st),
             kvabi.Component(name="value", dtype=spec.dtype, count=d, offset=d + 4,
                             strides={**st, "E": 1}),
             kvabi.Component(name="value_scale", dtype="float32", count=1, offset=2 * d + 4,
                             strides=st)]
    return Layout(sizes={"B": num_blocks, "N": n, "H": h}, components=comps)


def direct_per_token_head(x, dtype, rounding):
    """(codes as float64, scales) from the stated recipe in float64 with explicit float32
    roundings; int8 rounding in exact arithmetic, float8 through ml_dtypes."""
    x = np.asarray(x, np.float32).astype(np.float64)
    f32 = lambda a: np.asarray(a, np.float64).astype(np.float32).astype(np.float64)  # noqa
    s = np.maximum(f32(np.abs(x).max(-1) / QMAX[dtype]), f32(1e-6))
    y = f32(x * f32(1.0 / s)[..., None])
    if dtype == "int8":
        r = np.sign(y) * np.floor(np.abs(y) + 0.5) if rounding == "nearest_away" \
            else np.round(y)
        return np.clip(r, -128, 127), s
    return np.clip(y, -QMAX[dtype], QMAX[dtype]).astype(CODES[dtype]).astype(np.float64), s


@pytest.mark.parametrize("dtype,rounding", [("int8", "nearest_away"), ("int8", "nearest_even"),
                                            ("float8_e4m3fn", "nearest_even")])
def test_per_token_head_write_and_attention(dtype, rounding):
    rng = np.random.default_rng(3)
    spec = KVSpec("full", 4, 2, 8, dtype=dtype, quant="per_token_head", rounding=rounding)
    layout = packed_layout(spec, 8)
    ref = kvabi.get_backend("reference")
    meta = kvabi.CommonAttentionMetadata.from_lengths([3, 6], [0, 0], [[0, 1], [4, 5]], 4,
                                                      num_blocks=8)
    plan = ref.plan(meta, spec, layout, num_q_heads=4)
    key = (rng.standard_normal((9, 2, 8)) * rng.uniform(0.1, 3, (9, 2, 1))).astype(np.float32)
    val = (rng.standard_normal((9, 2, 8)) * rng.uniform(0.1, 3, (9, 2, 1))).astype(np.float32)
    key[4, 1] = 0.0  # an all-zero row
    cache = ref.write_kv(plan, ref.allocate(layout), key=key, value=val)
    raw = cache[0].view(np.uint8).reshape(8, 2, 4, 2 * (8 + 4))  # [B, H, N, record]
    slots = meta.slot_mapping
    rec = raw[slots // 4, :, slots % 4]  # [T, H, record]
    for x, lo in ((key, 0), (val, 12)):
        want, want_s = direct_per_token_head(x, dtype, rounding)
        got = rec[..., lo:lo + 8].copy().view(CODES.get(dtype, np.int8)).astype(np.float64)
        np.testing.assert_array_equal(got, want)
        got_s = rec[..., lo + 8:lo + 12].copy().view(np.float32)[..., 0].astype(np.float64)
        np.testing.assert_array_equal(got_s, want_s)
    assert rec[4, 1, 8:12].copy().view(np.float32)[0] == np.float32(1e-6)
    query = rng.standard_normal((9, 4, 8))
    out, lse = ref.attention(plan, cache, query=query, return_lse=True)
    kd = np.zeros((2, 8, 2, 8))
    vd = np.zeros((2, 8, 2, 8))
    for r, (blocks, n) in enumerate((([0, 1], 3), ([4, 5], 6))):
        rows = raw[blocks].transpose(0, 2, 1, 3).reshape(8, 2, 24)[:n]  # [pos, H, record]
        for dst, lo in ((kd, 0), (vd, 12)):
            codes = rows[..., lo:lo + 8].copy().view(CODES.get(dtype, np.int8))
            s = rows[..., lo + 8:lo + 12].copy().view(np.float32)
            dst[r, :n] = codes.astype(np.float64) * s.astype(np.float64)
    want, want_lse = dense_attention(meta, kd, vd, query)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_scale_components_must_match_the_spec():
    ref = kvabi.get_backend("reference")
    pth = KVSpec("full", 4, 1, 8, dtype="int8", quant="per_token_head",
                 rounding="nearest_away")
    plain = KVSpec("full", 4, 1, 8, dtype="int8", quant="per_tensor")
    meta = kvabi.CommonAttentionMetadata.from_lengths([2], [0], [[0]], 4, num_blocks=1)
    with pytest.raises(KVABIError, match="^layout.components: a per_token_head cache needs "
                                         "key_scale"):
        ref.plan(meta, pth, Layout.preset("flash_attn", plain, num_blocks=1), num_q_heads=1)
    with pytest.raises(KVABIError, match="^layout.components: hold scales"):
        ref.plan(meta, plain, packed_layout(pth, 1), num_q_heads=1)
    with pytest.raises(KVABIError, match="^spec.quant: preset 'vllm.LBHNC' stores no"):
        Layout.preset("vllm.LBHNC", pth, num_blocks=1)
    with pytest.raises(KVABIError, match="^k_scale: static scales are for a per_tensor"):
        lay = packed_layout(pth, 1)
        ref.write_kv(ref.plan(meta, pth, lay, num_q_heads=1), ref.allocate(lay),
                     key=np.ones((2, 1, 8)), value=np.ones((2, 1, 8)), k_scale=0.5)
