"""vLLM's own quantizing writers against kvabi's quantization oracle (``kvabi.model.quant``,
``specs/semantics.md`` section 11), byte for byte.

- CPU_ATTN's fp8 writer (``cpu_attn_reshape_and_cache(..., kv_cache_dtype="fp8"|"fp8_e5m2",
  k_scale, v_scale)``, compiled): per-tensor codes, rounding ``toward_zero``, from float32,
  float16 and bfloat16 inputs under generic (not power-of-two) scales.
- The Triton per-token-head writer (``int8_per_token_head``, ``fp8_per_token_head``) in
  Triton's interpreter (a child process, ``vllm_triton_writer.py``): int8 codes (rounding
  ``nearest_away``) and every float32 scale; fp8 scales, and fp8 codes of rows whose scaled
  values are codes (Triton's interpreter converts float32 to fp8 with its own emulation, not
  the GPU's round-to-nearest conversion, so only exact codes are pinned).

Bytes are decoded with the formulas stated here (CPU: per block and head keys ``[D, N]``
then values ``[N, D]``; Triton: per (block, head, token) ``[K | K scale | V | V scale]``),
never with the code under test.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kvabi
import kvabi.model.quant as q
from kvabi.util.dtypes import numpy_dtype

ops = pytest.importorskip("vllm._custom_ops")
cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")

WRITER = Path(__file__).with_name("vllm_triton_writer.py")
KV_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


# -- CPU_ATTN fp8 ----------------------------------------------------------------------------
def cpu_fp8_write(key, value, k_scale, v_scale, kv_cache_dtype, block_size=32):
    """(key codes, value codes) [T, H, D] as uint8, written by vLLM's compiled CPU writer
    into the cache CPU_ATTN allocates (``[B, H, N, 2 * D]`` viewed ``[B, H, 2N, D]``)."""
    t, h, d = key.shape
    b = -(-t // block_size)
    cache = torch.zeros(b, h, block_size, 2 * d, dtype=torch.uint8)
    kc, vc = cache.view(b, h, 2 * block_size, d).chunk(2, dim=2)
    isa = cpu_attn._get_attn_isa(key.dtype, block_size, d, kv_cache_dtype)
    ops.cpu_attn_reshape_and_cache(key, value, kc, vc, torch.arange(t), isa,
                                   k_scale=k_scale, v_scale=v_scale,
                                   kv_cache_dtype=kv_cache_dtype)
    tiles = cache.view(b, h, 2, block_size * d).numpy()
    keys = tiles[:, :, 0].reshape(b, h, d, block_size).transpose(0, 3, 1, 2)  # [B, N, H, D]
    vals = tiles[:, :, 1].reshape(b, h, block_size, d).transpose(0, 2, 1, 3)
    return keys.reshape(b * block_size, h, d)[:t], vals.reshape(b * block_size, h, d)[:t]


def spread(rng, shape, scale, qmax):
    """Values over every code range of a format under ``scale``: most within it, some
    subnormal, some saturating, some exactly at codes' midpoints."""
    y = rng.standard_normal(shape) * qmax / 4
    pick = rng.random(shape)
    y = np.where(pick < 0.03, y * 10, np.where(pick < 0.1, y * 1e-4, y))
    y = np.where(pick > 0.99, -0.0, np.where(pick > 0.98, -1e-30, y))  # signed zeros
    return y * scale


@pytest.mark.parametrize("kv_cache_dtype", list(KV_DTYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_fp8_writer_is_toward_zero_per_tensor(kv_cache_dtype, dtype):
    fmt = KV_DTYPES[kv_cache_dtype]
    qmax = q.FORMATS[fmt].qmax
    rng = np.random.default_rng(11)
    for ks, vs in ((0.37, 1.3), (2.0 ** -7, 0.0123), (1.0, 1.0)):
        ks32, vs32 = q.as_scale(ks, "k_scale"), q.as_scale(vs, "v_scale")
        big = float(torch.finfo(dtype).max) / 2  # saturating, yet finite in the input dtype
        key = torch.from_numpy(spread(rng, (96, 2, 32), ks32, qmax).clip(-big, big)).to(dtype)
        value = torch.from_numpy(spread(rng, (96, 2, 32), vs32, qmax).clip(-big, big)).to(dtype)
        got_k, got_v = cpu_fp8_write(key, value, ks32, vs32, kv_cache_dtype)
        x_k, x_v = key.float().numpy(), value.float().numpy()
        want_k = q.quantize_per_tensor(x_k, ks32, fmt, "toward_zero").view(np.uint8)
        want_v = q.quantize_per_tensor(x_v, vs32, fmt, "toward_zero").view(np.uint8)
        np.testing.assert_array_equal(got_k, want_k)
        np.testing.assert_array_equal(got_v, want_v)
        # the writer does not round to nearest: the stated rounding is what pins it
        nearest = q.quantize_per_tensor(x_v, vs32, fmt, "nearest_even").view(np.uint8)
        assert (got_v != nearest).mean() > 0.2


# -- Triton per-token-head, interpreted --------------------------------------------------------
def rows(rng, shape):
    """float32 rows of magnitudes 1e-8 .. 1e3, one all zero."""
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-8, 3, tuple(shape[:-1]) + (1,))
    x[0, 0] = 0.0
    return x.astype(np.float32)


def code_rows(rng, shape, fmt):
    """float32 rows whose scaled values are codes: ``code * 2**k`` with one element
    ``+-QMAX * 2**k`` per row, so the scale is ``2**k`` exactly and any rounding agrees."""
    table = np.arange(256, dtype=np.uint8).view(numpy_dtype(fmt)).astype(np.float64)
    # no negative zero: the roundings disagree on its sign (toward_zero gives +0)
    table = table[np.isfinite(table) & ~((table == 0) & np.signbit(table))]
    qmax = q.FORMATS[fmt].qmax
    x = rng.choice(table, size=shape)
    x[..., 0] = qmax * rng.choice([-1.0, 1.0], size=shape[:-1])
    k = rng.integers(-12, 4, size=tuple(shape[:-1]) + (1,))
    return (x * 2.0 ** k).astype(np.float32)


@pytest.fixture(scope="module")
def triton_writes(tmp_path_factory):
    """Run the interpreted writer once for every case: {name: (inputs, outputs)}."""
    d = tmp_path_factory.mktemp("triton")
    rng = np.random.default_rng(5)
    t, h, dim, n, b = 40, 2, 32, 16, 4
    slots = rng.permutation(b * n)[:t].astype(np.int64)
    slots[3] = -1  # a padding token: never written
    cases = {
        "int8": dict(mode="int8_per_token_head", order="HND",
                     key=rows(rng, (t, h, dim)), value=rows(rng, (t, h, dim))),
        "int8_nhd": dict(mode="int8_per_token_head", order="NHD",
                         key=rows(rng, (t, h, dim)), value=rows(rng, (t, h, dim))),
        "fp8": dict(mode="fp8_per_token_head", order="HND",
                    key=code_rows(rng, (t, h, dim), "float8_e4m3fn"),
                    value=code_rows(rng, (t, h, dim), "float8_e4m3fn")),
        "fp8_scales": dict(mode="fp8_per_token_head", order="HND",
                           key=rows(rng, (t, h, dim)), value=rows(rng, (t, h, dim))),
    }
    args = []
    for name, c in cases.items():
        c.update(slots=slots, num_blocks=b, block_size=n, fill=0xA5)
        np.savez(d / f"{name}.in.npz", **c)
        args += [str(d / f"{name}.in.npz"), str(d / f"{name}.out.npz")]
    subprocess.run([sys.executable, str(WRITER), *args], check=True, timeout=600)
    out = {}
    for name, c in cases.items():
        with np.load(d / f"{name}.out.npz") as f:
            out[name] = (c, {k: f[k] for k in f.files})
    return out


def decode_packed(raw, shape, strides, slots, dim):
    """(key codes, key scales, value codes, value scales) of each slot [T, H, ...] from the
    packed ``[B, H, N, 2 * (D + 4)]`` bytes: per (block, head, token) ``[K(D) | K scale
    (float32) | V(D) | V scale]`` at the packed tensor's element strides."""
    b, h, n, c = shape
    sb, sh, sn, _ = strides
    blk, off = slots // n, slots % n
    base = blk[:, None] * sb + np.arange(h)[None, :] * sh + off[:, None] * sn  # [T, H]
    e = np.arange(dim)
    kq = raw[base[..., None] + e]
    vq = raw[base[..., None] + dim + 4 + e]
    four = np.arange(4)
    ks = raw[base[..., None] + dim + four].copy().view(np.float32)[..., 0]
    vs = raw[base[..., None] + 2 * dim + 4 + four].copy().view(np.float32)[..., 0]
    return kq, ks, vq, vs


@pytest.mark.parametrize("name", ["int8", "int8_nhd"])
def test_triton_int8_per_token_head_codes_and_scales(triton_writes, name):
    inp, out = triton_writes[name]
    real = inp["slots"] >= 0
    kq, ks, vq, vs = decode_packed(out["raw"], out["shape"], out["strides"],
                                   inp["slots"][real], 32)
    for x, codes, scales in ((inp["key"], kq, ks), (inp["value"], vq, vs)):
        want, want_s = q.quantize_per_token_head(x[real], "int8", "nearest_away")
        np.testing.assert_array_equal(scales.view(np.uint32), want_s.view(np.uint32))
        np.testing.assert_array_equal(codes, want.view(np.uint8))
    assert ks[0, 0] == np.float32(1e-6)  # the all-zero row: vLLM's epsilon
    # nothing else was written: unwritten slots keep the fill byte in their codes
    b, h, n, c = out["shape"]
    free = np.setdiff1d(np.arange(b * n), inp["slots"][real])
    fk, _, fv, _ = decode_packed(out["raw"], out["shape"], out["strides"], free, 32)
    assert (fk == 0xA5).all() and (fv == 0xA5).all()


def test_triton_fp8_per_token_head_codes_and_scales(triton_writes):
    inp, out = triton_writes["fp8"]
    real = inp["slots"] >= 0
    kq, ks, vq, vs = decode_packed(out["raw"], out["shape"], out["strides"],
                                   inp["slots"][real], 32)
    for x, codes, scales in ((inp["key"], kq, ks), (inp["value"], vq, vs)):
        for rounding in ("nearest_even", "toward_zero"):  # exact codes: both agree
            want, want_s = q.quantize_per_token_head(x[real], "float8_e4m3fn", rounding)
            np.testing.assert_array_equal(scales.view(np.uint32), want_s.view(np.uint32))
            np.testing.assert_array_equal(codes, want.view(np.uint8))
    inp, out = triton_writes["fp8_scales"]
    _, ks, _, vs = decode_packed(out["raw"], out["shape"], out["strides"],
                                 inp["slots"][real], 32)
    for x, scales in ((inp["key"], ks), (inp["value"], vs)):
        _, want_s = q.quantize_per_token_head(x[real], "float8_e4m3fn", "nearest_even")
        np.testing.assert_array_equal(scales.view(np.uint32), want_s.view(np.uint32))


# -- the packed per-token-head layout, pinned against the writer's bytes -----------------------
def packed_components(dtype, d, h, n, order="HND", swap_kv=False, swap_scales=False):
    """vLLM's per-token-head record per (block, head, token) ``[K | K scale | V | V scale]``
    stated as kvabi components over ``[B, H, N, record]`` (HND) or ``[B, N, H, record]``
    (NHD) memory.  ``swap_kv``/``swap_scales`` plant faults (K and V exchanged; each scale
    at the other's place)."""
    rec = 2 * (d + 4)
    st = {"B": h * n * rec, "H": n * rec, "N": rec} if order == "HND" else \
        {"B": h * n * rec, "N": h * rec, "H": rec}
    k0, v0 = (d + 4, 0) if swap_kv else (0, d + 4)
    ks, vs = (v0 + d, k0 + d) if swap_scales else (k0 + d, v0 + d)
    return [kvabi.Component(name="key", dtype=dtype, count=d, offset=k0, strides={**st, "E": 1}),
            kvabi.Component(name="key_scale", dtype="float32", count=1, offset=ks, strides=st),
            kvabi.Component(name="value", dtype=dtype, count=d, offset=v0,
                            strides={**st, "E": 1}),
            kvabi.Component(name="value_scale", dtype="float32", count=1, offset=vs,
                            strides=st)]


def reference_bytes(inp, layout, spec):
    """The reference's write of the writer's inputs into ``layout``, over the same starting
    bytes as vLLM's cache: the fill byte, every scale 1.0 (``_ensure_scale_caches``)."""
    ref = kvabi.get_backend("reference")
    cache = ref.allocate(layout)
    cache[0].view(np.uint8)[...] = int(inp["fill"])
    for name in ("key_scale", "value_scale"):
        cache.component_view(name, 0)[...] = 1.0
    slots = inp["slots"]
    real = slots >= 0
    n = spec.block_size
    # one decode per written token, at the position its slot holds (block column 0)
    meta = kvabi.CommonAttentionMetadata.from_lengths(
        np.ones(real.sum(), np.int64), slots[real] % n, (slots[real] // n)[:, None], n,
        num_blocks=layout.num_blocks)
    plan = ref.plan(meta, spec, layout, num_q_heads=spec.num_kv_heads)
    ref.write_kv(plan, cache, key=inp["key"][real], value=inp["value"][real])
    return cache[0].view(np.uint8).reshape(-1)


@pytest.mark.parametrize("name", ["int8", "int8_nhd", "fp8"])
def test_packed_layout_is_the_writers_bytes(triton_writes, name):
    inp, out = triton_writes[name]
    dtype = "int8" if name.startswith("int8") else "float8_e4m3fn"
    rounding = "nearest_away" if dtype == "int8" else "nearest_even"
    t, h, d = inp["key"].shape
    b, n = int(inp["num_blocks"]), int(inp["block_size"])
    spec = kvabi.KVSpec("full", n, h, d, dtype=dtype, quant="per_token_head",
                        rounding=rounding)
    order = str(inp["order"])
    good = kvabi.Layout(sizes={"B": b, "N": n, "H": h},
                        components=packed_components(dtype, d, h, n, order))
    np.testing.assert_array_equal(reference_bytes(inp, good, spec), out["raw"])
    if order == "HND":  # the preset vLLM's backend allocates is this cache, byte for byte
        preset = kvabi.Layout.preset(f"vllm.{inp['mode']}", spec, b)
        np.testing.assert_array_equal(reference_bytes(inp, preset, spec), out["raw"])
    for fault in (dict(swap_kv=True), dict(swap_scales=True)):
        try:
            bad = kvabi.Layout(sizes={"B": b, "N": n, "H": h},
                               components=packed_components(dtype, d, h, n, order, **fault))
        except kvabi.KVABIError:
            continue  # refused as a descriptor: caught too
        assert not np.array_equal(reference_bytes(inp, bad, spec), out["raw"]), fault


# -- vllm.cpu with fp8: the preset and the rounding, against the CPU writer's bytes ------------
@pytest.mark.parametrize("kv_cache_dtype", list(KV_DTYPES))
def test_vllm_cpu_fp8_preset_is_the_writers_bytes(kv_cache_dtype):
    """The reference's write into ``Layout.preset("vllm.cpu", ...)`` of an fp8 per-tensor
    spec (rounding toward_zero) is vLLM's CPU writer's cache byte for byte, generic scales
    and values over every code range; the writer with K and V swapped, or with the scales
    swapped, is not."""
    fmt = KV_DTYPES[kv_cache_dtype]
    blocks, heads, n, d = 3, 2, 32, 64
    spec = kvabi.KVSpec("full", n, heads, d, dtype=fmt, quant="per_tensor",
                        rounding="toward_zero")
    layout = kvabi.Layout.preset("vllm.cpu", spec, num_blocks=blocks)
    rng = np.random.default_rng(3)
    ks, vs = q.as_scale(0.0371, "k_scale"), q.as_scale(0.0213, "v_scale")
    t = blocks * n - 5
    qmax = q.FORMATS[fmt].qmax
    key = spread(rng, (t, heads, d), ks, qmax).astype(np.float32)
    value = spread(rng, (t, heads, d), vs, qmax).astype(np.float32)
    slots = rng.permutation(blocks * n)[:t]
    ref = kvabi.get_backend("reference")
    meta = kvabi.CommonAttentionMetadata.from_lengths(
        np.ones(t, np.int64), slots % n, (slots // n)[:, None], n, num_blocks=blocks)
    cache = ref.write_kv(ref.plan(meta, spec, layout, num_q_heads=heads), ref.allocate(layout),
                         key=key, value=value, k_scale=ks, v_scale=vs)
    want = np.asarray(cache[0]).view(np.uint8).reshape(-1)

    def vllm_write(k, v, k_scale, v_scale):
        c = torch.zeros(blocks, heads, n, 2 * d, dtype=torch.uint8)  # CPU_ATTN's allocation
        kc, vc = c.view(blocks, heads, 2 * n, d).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(torch.from_numpy(k), torch.from_numpy(v), kc, vc,
                                       torch.from_numpy(slots.astype(np.int64)), "vec",
                                       k_scale=k_scale, v_scale=v_scale,
                                       kv_cache_dtype=kv_cache_dtype)
        return c.numpy().reshape(-1)

    np.testing.assert_array_equal(vllm_write(key, value, ks, vs), want)
    assert not np.array_equal(vllm_write(value, key, ks, vs), want)  # K and V swapped
    assert not np.array_equal(vllm_write(key, value, vs, ks), want)  # scales swapped
