"""kvabi.model.quant against direct formulas: every code of every format enumerated, rounding
decided in exact float64 arithmetic on the sorted code table, ml_dtypes' own conversion,
and the scale recipe written out in float64 with explicit float32 roundings."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from kvabi import KVABIError, KVSpec
from kvabi.model.quant import (FORMATS, as_scale, check_quant, dequantize, quantize_per_tensor,
                         quantize_per_token_head, round_codes)

F8 = {"float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2}


def code_table(dtype):
    """Every finite non-negative code of a float8 format, ascending, as float64."""
    c = np.arange(256, dtype=np.uint8).view(F8[dtype]).astype(np.float64)
    return np.unique(c[np.isfinite(c) & (c >= 0)])


def fl32(x):
    """float64 -> nearest float32 (ties to even), back in float64."""
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def direct_nearest_even(y, dtype):
    """Nearest code to |y| (ties to the code with an even last mantissa bit), saturated."""
    codes = code_table(dtype)
    a = np.minimum(np.abs(y), codes[-1])
    hi = np.clip(np.searchsorted(codes, a, side="left"), 0, len(codes) - 1)
    lo = np.clip(hi - 1, 0, len(codes) - 1)
    dlo, dhi = a - codes[lo], codes[hi] - a
    even_hi = (codes[hi].astype(F8[dtype]).view(np.uint8) & 1) == 0
    pick = np.where((dhi < dlo) | ((dhi == dlo) & even_hi), hi, lo)
    return np.copysign(codes[pick], y)


def direct_toward_zero(y, dtype):
    """The largest code <= |y| after the stated subnormal pre-rounding (e4m3fn only):
    |y| below the smallest normal m is first rounded to the nearest multiple of float32's
    spacing in [m, 2m) (ties to even multiples)."""
    fmt = FORMATS[dtype]
    codes = code_table(dtype)
    a = np.minimum(np.abs(y), codes[-1])
    if fmt.snap_subnormals:
        grid = fmt.min_normal * 2.0 ** -23
        sub = a < fmt.min_normal
        a = np.where(sub, np.round(a / grid) * grid, a)  # np.round: half to even
    idx = np.searchsorted(codes, a, side="right") - 1
    return np.where(y < 0, -codes[idx], codes[idx])  # -0.0 in: +0 out


def samples(dtype, rng):
    """float32 values around every code: the codes, midpoints, a float32 step either side
    of both, both signs, plus random magnitudes over the whole range and beyond it."""
    codes = code_table(dtype).astype(np.float32)
    mid = ((codes[:-1].astype(np.float64) + codes[1:]) / 2).astype(np.float32)
    pts = np.concatenate([codes, mid])
    near = np.concatenate([pts, np.nextafter(pts, np.float32(0)),
                           np.nextafter(pts, np.float32(np.inf))])
    wide = rng.standard_normal(4000).astype(np.float32) * \
        np.float32(10.0) ** rng.uniform(-8, 6, 4000).astype(np.float32)
    y = np.concatenate([near, -near, wide])
    return y[np.isfinite(y)]


@pytest.mark.parametrize("dtype", list(F8))
def test_float8_nearest_even_matches_direct_formula_and_ml_dtypes(dtype):
    y = samples(dtype, np.random.default_rng(0))
    got = round_codes(y, dtype, "nearest_even").astype(np.float64)
    np.testing.assert_array_equal(got, direct_nearest_even(y.astype(np.float64), dtype))
    qmax = FORMATS[dtype].qmax
    ml = np.clip(y, -qmax, qmax).astype(F8[dtype]).astype(np.float64)
    np.testing.assert_array_equal(got, ml)


@pytest.mark.parametrize("dtype", list(F8))
def test_float8_toward_zero_matches_direct_formula(dtype):
    y = samples(dtype, np.random.default_rng(1))
    got = round_codes(y, dtype, "toward_zero").astype(np.float64)
    np.testing.assert_array_equal(got, direct_toward_zero(y.astype(np.float64), dtype))
    # never away from zero by more than the pre-rounding, never past the saturation bound
    assert (np.abs(got) <= FORMATS[dtype].qmax).all()


def test_toward_zero_signs_of_zero():
    """A negative zero input gives +0, a negative value truncated to zero gives -0."""
    y = np.array([-0.0, 0.0, -1e-30, 1e-30], np.float32)
    for dtype in F8:
        bits = round_codes(y, dtype, "toward_zero").view(np.uint8).tolist()
        assert bits == [0, 0, 0x80, 0], dtype


def test_e4m3_toward_zero_subnormal_prerounding_is_stated_exactly():
    # 2**-9 is e4m3fn's smallest subnormal; float32 spacing at 2**-6 is 2**-29.  A value
    # 2**-30 below it is a tie on that grid and goes to the even multiple (the code); one a
    # float32 step further down truncates to zero.
    c = np.float32(2.0 ** -9)
    tie = np.float32(2.0 ** -9 - 2.0 ** -30)
    below = np.nextafter(tie, np.float32(0))
    got = round_codes(np.array([c, tie, below], np.float32), "float8_e4m3fn", "toward_zero")
    assert got.astype(np.float64).tolist() == [2.0 ** -9, 2.0 ** -9, 0.0]
    # e5m2 truncates subnormals without pre-rounding
    c5 = np.float32(2.0 ** -16)
    got5 = round_codes(np.array([c5, np.nextafter(c5, np.float32(0))], np.float32),
                       "float8_e5m2", "toward_zero")
    assert got5.astype(np.float64).tolist() == [2.0 ** -16, 0.0]


def test_int8_roundings_match_direct_formula():
    rng = np.random.default_rng(2)
    halves = np.arange(-130, 131, dtype=np.float64) + 0.5
    y = np.concatenate([halves, np.nextafter(halves, 0), rng.uniform(-200, 200, 5000),
                        [0.5 - 2.0 ** -25, -(0.5 - 2.0 ** -25)]]).astype(np.float32)
    a = y.astype(np.float64)
    even = np.clip(np.round(a), -128, 127)  # np.round: half to even, exact in float64
    np.testing.assert_array_equal(round_codes(y, "int8", "nearest_even"), even)
    away = np.clip(np.sign(a) * np.floor(np.abs(a) + 0.5), -128, 127)
    # the stated float32 recipe also rounds +-(0.5 - 2**-25) away from zero
    quirk = np.abs(a) == 0.5 - 2.0 ** -25
    away[quirk] = np.sign(a[quirk])
    np.testing.assert_array_equal(round_codes(y, "int8", "nearest_away"), away)


@pytest.mark.parametrize("dtype,rounding", [("float8_e4m3fn", "nearest_even"),
                                            ("float8_e4m3fn", "toward_zero"),
                                            ("float8_e5m2", "nearest_even"),
                                            ("int8", "nearest_away"), ("int8", "nearest_even")])
def test_per_token_head_scale_recipe(dtype, rounding):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((40, 3, 16)) *
         10.0 ** rng.uniform(-9, 3, (40, 3, 1))).astype(np.float32)
    x[0, 0] = 0.0  # an all-zero row gets the epsilon scale and zero codes
    codes, s = quantize_per_token_head(x, dtype, rounding)
    qmax = FORMATS[dtype].qmax
    amax = np.abs(x.astype(np.float64)).max(-1)
    want_s = np.maximum(fl32(amax / qmax), fl32(1e-6))  # one correctly rounded division
    np.testing.assert_array_equal(s.astype(np.float64), want_s)
    r = fl32(1.0 / want_s)
    y = fl32(x.astype(np.float64) * r[..., None])
    np.testing.assert_array_equal(codes.astype(np.float64),
                                  round_codes(y.astype(np.float32), dtype, rounding)
                                  .astype(np.float64))
    assert (codes[0, 0].astype(np.float64) == 0).all() and s[0, 0] == np.float32(1e-6)
    # the largest element of each row maps to the format's bound (or, truncated, to the
    # code below it: e4m3fn 416)
    big = np.abs(codes.astype(np.float64)).max(-1)[amax > 1e-6 * qmax]
    assert (big >= qmax * 0.9).all() and (big <= qmax).all()


def test_per_tensor_reciprocal_multiply_and_saturation():
    x = np.array([1.0, -3.0, 1e6, -1e6, 0.0, 2.0 ** -20], np.float32)
    s = as_scale(0.3, "k_scale")
    assert s == float(np.float32(0.3))
    got = quantize_per_tensor(x, s, "float8_e4m3fn", "nearest_even").astype(np.float64)
    y = fl32(x.astype(np.float64) * fl32(1.0 / s))
    np.testing.assert_array_equal(got, direct_nearest_even(y, "float8_e4m3fn"))
    assert got[2] == 448.0 and got[3] == -448.0


def test_dequantize_is_exact_product():
    codes = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    codes = codes[np.isfinite(codes.astype(np.float32))].reshape(-1, 2)
    s = np.float32(0.1234567)
    got = dequantize(codes, s)
    want = codes.astype(np.float64) * np.float64(s)
    np.testing.assert_array_equal(got, want)
    rows = np.linspace(0.5, 2, len(codes)).astype(np.float32)
    np.testing.assert_array_equal(dequantize(codes, rows),
                                  codes.astype(np.float64) * rows.astype(np.float64)[:, None])


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), 1e-45, 1e39, True, "1"])
def test_static_scale_refused_by_field(bad):
    with pytest.raises(KVABIError, match="k_scale"):
        as_scale(bad, "k_scale")


def test_non_finite_input_refused_naming_the_element():
    x = np.zeros((2, 1, 4), np.float32)
    x[1, 0, 2] = np.nan
    with pytest.raises(KVABIError, match=r"value: .*\(1, 0, 2\)"):
        quantize_per_token_head(x, "int8", "nearest_away", field="value")
    with pytest.raises(KVABIError, match="key: .*finite"):
        quantize_per_tensor(np.array([1e39]), 1.0, "float8_e4m3fn", "nearest_even")


@pytest.mark.parametrize("kw,field", [
    (dict(quant="per_channel"), "quant"),
    (dict(dtype="bfloat16", quant="per_tensor"), "dtype"),
    (dict(dtype="int8", quant="per_tensor", rounding="toward_zero"), "rounding"),
    (dict(dtype="float8_e5m2", quant="per_tensor", rounding="nearest_away"), "rounding"),
    (dict(dtype="float8_e4m3fn", rounding="toward_zero"), "rounding"),
    (dict(rounding="up"), "rounding"),
])
def test_kvspec_refuses_bad_quantization_by_field(kw, field):
    with pytest.raises(KVABIError, match=f"^{field}:"):
        KVSpec("full", 16, 2, 64, **kw)


def test_kvspec_quantized_costs_and_mla():
    s = KVSpec("full", 16, 2, 64, dtype="int8", quant="per_token_head", rounding="nearest_away")
    assert s.is_quantized and s.bytes_per_token == 2 * 128 + 2 * 2 * 4
    t = KVSpec("full", 16, 2, 64, dtype="float8_e4m3fn", quant="per_tensor")
    assert t.bytes_per_token == 256  # static scales are layer state, not cache bytes
    KVSpec("mla", 16, 1, 576, dtype="float8_e4m3fn", head_dim_v=512, quant="per_tensor")
    with pytest.raises(KVABIError, match="^quant:"):
        KVSpec("mla", 16, 1, 576, dtype="float8_e4m3fn", head_dim_v=512,
               quant="per_token_head")
    check_quant("none", "nearest_even", "float32")


LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "hidden_size": 512, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("qc", [
    {"kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor",
                         "dynamic": False, "symmetric": True}},
    {"kv_cache_quant_algo": "FP8"}])
def test_hf_config_states_a_per_tensor_fp8_cache(qc):
    from kvabi import ModelKV

    m = ModelKV.from_hf_config({**LLAMA, "quantization_config": qc})
    spec = m.layers[0].spec
    assert (spec.dtype, spec.quant, spec.rounding) == ("float8_e4m3fn", "per_tensor",
                                                       "nearest_even")
    assert ModelKV.from_hf_config(LLAMA).layers[0].spec.quant == "none"
    # an explicit dtype wins over the config; kv_quant and rounding say the rest
    assert ModelKV.from_hf_config({**LLAMA, "quantization_config": qc},
                                  kv_dtype="bfloat16").layers[0].spec.quant == "none"
    s = ModelKV.from_hf_config(LLAMA, kv_dtype="fp8_e5m2", kv_quant="per_tensor",
                               rounding="toward_zero").layers[0].spec
    assert (s.dtype, s.quant, s.rounding) == ("float8_e5m2", "per_tensor", "toward_zero")


@pytest.mark.parametrize("qc,field", [
    ({"kv_cache_scheme": {"type": "int", "num_bits": 8}},
     "quantization_config.kv_cache_scheme"),
    ({"kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "attn_head"}},
     "quantization_config.kv_cache_scheme.strategy"),
    ({"kv_cache_scheme": {"type": "float", "num_bits": 8, "symmetric": False}},
     "quantization_config.kv_cache_scheme.symmetric"),
    ({"kv_cache_scheme": {"type": "float", "num_bits": 8.0}},
     "quantization_config.kv_cache_scheme"),
    ({"kv_cache_quant_algo": "NVFP4"}, "quantization_config.kv_cache_quant_algo"),
    ("fp8", "quantization_config")])
def test_hf_config_quantization_refused_by_field(qc, field):
    from kvabi import ModelKV

    with pytest.raises(KVABIError, match=f"^{field}:"):
        ModelKV.from_hf_config({**LLAMA, "quantization_config": qc})
    with pytest.raises(KVABIError, match="^dtype:"):
        ModelKV.from_hf_config(LLAMA, kv_quant="per_tensor")  # bfloat16 holds no codes
