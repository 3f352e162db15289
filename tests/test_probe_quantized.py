"""``verify_quantized``: a quantizing writer (written here from vLLM's per-token-head
definition: scale = absmax / qmax per (token, head), values rounded and saturated, stored
``[K | K_scale | V | V_scale]`` per (head, slot) of ``[B, H, N, 2 * (D + 4)]``) is verified
against the presets; planted faults (a scale moved, K and V swapped) are caught, naming the
component and where the scale's bytes went."""
from __future__ import annotations

import numpy as np
import pytest

from kvabi import KVABIError, KVSpec, Layout
from kvabi.util.dtypes import numpy_dtype
from kvabi.probe import verify_quantized

B, H, N, D = 4, 2, 4, 16
SPEC = KVSpec(kind="full", block_size=N, num_kv_heads=H, head_dim=D, dtype="float16")
QMAX = {"int8": 127, "float8_e4m3fn": 448}


def writer(dtype, fault=None):
    """A cache [B, H, N, 2 * (D + 4)] bytes and its quantizing write."""
    cache = np.zeros((B, H, N, 2 * (D + 4)), np.uint8)

    def quantize(x):
        scale = (np.abs(x).max(-1, keepdims=True) / QMAX[dtype]).astype(np.float32)
        y = x / scale
        if dtype == "int8":
            q = np.clip(np.rint(y), -127, 127).astype(np.int8).view(np.uint8)
        else:
            q = np.clip(y, -448, 448).astype(numpy_dtype(dtype)).view(np.uint8)
        return q, scale.view(np.uint8)

    def write(layer, slots, key, value):
        assert layer == 0 and key.dtype == np.float32
        kq, ks = quantize(key)
        vq, vs = quantize(value)
        if fault == "swap":
            kq, vq = vq, kq
        for i, slot in enumerate(slots):
            b, n = divmod(int(slot), N)
            rec = cache[b, :, n]  # [H, 2 * (D + 4)]
            rec[:, :D] = kq[i]
            at = D + 4 + D if fault == "scale" else D  # planted: K's scale after V's data
            rec[:, at:at + 4] = ks[i].reshape(H, 4)
            rec[:, D + 4:2 * D + 4] = vq[i]
            if fault != "scale":
                rec[:, 2 * D + 4:] = vs[i].reshape(H, 4)
    return cache, write


@pytest.mark.parametrize("dtype,name", [("int8", "vllm.int8_per_token_head"),
                                        ("float8_e4m3fn", "vllm.fp8_per_token_head")])
def test_a_quantizing_write_is_verified_and_faults_are_caught(dtype, name):
    layout = Layout.preset(name, SPEC, B)
    cache, write = writer(dtype)
    got = verify_quantized(layout, [cache], write, samples=6, seed=3)
    assert got == {"key": 6 * H * D, "key_scale": 6 * H, "value": 6 * H * D,
                   "value_scale": 6 * H}
    assert not cache.any()  # the sampled cells were restored
    cache, write = writer(dtype, "scale")
    with pytest.raises(KVABIError, match=r"^key_scale of layer 0, block \d, token \d, head 0: "
                                         r"the scale .* is not at plane 0, byte \d+, where "
                       + name.replace(".", r"\.") + r" puts it \(its bytes are at plane 0, "):
        verify_quantized(layout, [cache], write)
    cache, write = writer(dtype, "swap")
    with pytest.raises(KVABIError, match=r"^key of layer 0, .* not the value written"):
        verify_quantized(layout, [cache], write)


def test_what_it_does_not_check_is_refused_by_name():
    with pytest.raises(KVABIError, match="int8 or float8 data"):
        verify_quantized(Layout.preset("vllm.cpu", SPEC, B), [np.zeros(1 << 16, np.uint8)],
                         lambda *a: None)
    cache, write = writer("int8")
    with pytest.raises(KVABIError, match="planes: .* has 1 planes, got 2"):
        verify_quantized(Layout.preset("vllm.int8_per_token_head", SPEC, B), [cache, cache],
                         write)
