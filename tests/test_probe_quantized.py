"""``verify_quantized``: quantizing writers are verified against the quantized presets, and
placement faults are caught, naming the component and where a scale's bytes went.

Writers: one written here from vLLM's per-token-head definition (scale = absmax / qmax per
(token, head), values divided, rounded and saturated, stored ``[K | K_scale | V | V_scale]``
per (head, slot) of ``[B, H, N, 2 * (D + 4)]``); the reference backend's own ``write_kv``
(the probe and the oracle agree on every preset the reference writes, every rounding); one
written from DeepSeek's ``fp8_ds_mla`` definition (656 bytes a token: 512 e4m3 latent values
in 4 tiles of 128, each tile's float32 scale = its absmax / 448, the values divided by it;
then 64 bfloat16 rope values); FlashInfer's two fp8 scale proposals (inline at byte D of a
16-byte-padded slot, or a scale plane beside the data plane); and one with a scale per token
shared by its heads.  vLLM's own Triton writer is probed in
integrations/vllm/tests/test_quant_writers.py.
"""
from __future__ import annotations

import re

import attrs
import ml_dtypes
import numpy as np
import pytest

import kvabi
from kvabi import Component, KVABIError, KVSpec, Layout
from kvabi.util.dtypes import numpy_dtype
from kvabi.probe import WriteRefused, backend_writer, verify_quantized
from kvabi.probe.quantized import EXPONENTS
from kvabi.backend.reference import ReferenceBackend

B, H, N, D = 4, 2, 4, 16
SPEC = KVSpec(kind="full", block_size=N, num_kv_heads=H, head_dim=D, dtype="float16")
QMAX = {"int8": 127, "float8_e4m3fn": 448}
MLA = KVSpec(kind="mla", block_size=N, num_kv_heads=1, head_dim=576, head_dim_v=512,
             dtype="bfloat16")


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
    with pytest.raises(KVABIError, match=r"^key of layer 0, .* not the code written"):
        verify_quantized(layout, [cache], write)


@pytest.mark.parametrize("name", ["vllm.int8_per_token_head", "vllm.fp8_per_token_head",
                                  "flashinfer.HND.fp8_inline_scale",
                                  "flashinfer.HND.fp8_scale_plane"])
def test_the_reference_writer_passes_on_every_quantized_preset_and_rounding(name):
    """The probe and the oracle share one recipe: kvabi's own quantizing write (the
    reference's) is verified, for every rounding of the preset's dtype and at shapes where
    a scale of 3 significant bits once fell under the 1e-6 floor (head_dim 64)."""
    ref = kvabi.get_backend("reference")
    for dtype in ("int8", "float8_e4m3fn"):
        for rounding in kvabi.model.quant.FORMATS[dtype].roundings:
            spec = KVSpec(kind="full", block_size=16, num_kv_heads=2, head_dim=64,
                          dtype=dtype, quant="per_token_head", rounding=rounding)
            try:
                layout = Layout.preset(name, spec, 8, 2)
            except KVABIError:
                continue
            if layout.component("key").dtype != dtype:
                continue
            planes, write = backend_writer(ref, layout, spec)
            got = verify_quantized(layout, planes, write, samples=12, seed=1)
            assert got["key"] == 12 * 2 * 64 and got["value_scale"] == 12 * 2


def test_probe_codes_and_scales_are_the_oracles_and_decode_to_the_values():
    """What the probe expects is what kvabi.model.quant stores, and code * scale gives back the
    value written, exactly (an independent check of the expectation)."""
    from kvabi.probe.quantized import Part, expected, group_values

    rng = np.random.default_rng(0)
    for dtype in ("int8", "float8_e4m3fn", "float8_e5m2"):
        part = Part("latent", "latent_scale", dtype, 512, 128, True)
        groups = np.arange(3 * 2 * 4).reshape(3, 2, 4)
        x, e = group_values(part, groups, rng)
        codes, scales = expected(part, x)
        assert np.array_equal(scales, np.exp2(e).astype(np.float32))
        values = codes.view(numpy_dtype(dtype)).astype(np.float64).reshape(3, 2, 4, 128)
        assert np.array_equal(values * scales[..., None], x.reshape(3, 2, 4, 128))
        assert np.all(np.exp2(EXPONENTS.astype(float)) >= 1e-6)


def ds_mla_writer(num_layers, fault=None):
    """DeepSeek's fp8_ds_mla cache ``[L, B, N, 656]`` bytes and its write, from the format's
    definition (vLLM's kernel divides each tile by its scale, rounds to nearest e4m3,
    saturating)."""
    cache = np.zeros((num_layers, B, N, 656), np.uint8)

    def write(layer, slots, key, value):
        assert value is None and key.shape[1:] == (1, 576) and key.dtype == np.float32
        for i, slot in enumerate(slots):
            b, n = divmod(int(slot), N)
            tiles = key[i, 0, :512].reshape(4, 128)
            if fault == "one_scale":  # one scale for the whole latent
                scale = np.full(4, np.abs(tiles).max() / np.float32(448), np.float32)
            else:
                scale = (np.abs(tiles).max(axis=1) / np.float32(448)).astype(np.float32)
            q = np.clip(tiles / scale[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
            rec = cache[layer, b, n]
            rec[:512] = q.view(np.uint8).ravel()
            stored = scale[::-1] if fault == "scale_order" else scale  # planted: tiles reversed
            rec[512:528] = np.ascontiguousarray(stored).view(np.uint8)
            rope = key[i, 0, 512:].astype(ml_dtypes.bfloat16).view(np.uint8)
            if fault == "rope_shift":  # one element late: its first 2 bytes never written
                rec[530:] = rope[:-2]
            else:
                rec[528:] = rope
    return cache, write


def test_deepseek_tile_scaled_record_is_verified_and_faults_are_caught():
    layout = Layout.preset("deepseek.fp8_ds_mla", MLA, B, 2)
    cache, write = ds_mla_writer(2)
    got = verify_quantized(layout, [cache], write, samples=5, seed=2)
    assert got == {"latent": 5 * 512, "rope": 5 * 64, "latent_scale": 5 * 4}
    assert not cache.any()
    cache, write = ds_mla_writer(2, "scale_order")
    with pytest.raises(KVABIError, match=r"^latent_scale of layer \d, block \d, token \d, head "
                                         r"0, tile 0: the scale .* where deepseek\.fp8_ds_mla "
                                         r"puts it \(its bytes are at plane 0, byte \d+"):
        verify_quantized(layout, [cache], write)
    cache, write = ds_mla_writer(2, "one_scale")
    with pytest.raises(KVABIError, match=r"^latent of layer .* not the code written"):
        verify_quantized(layout, [cache], write)
    cache, write = ds_mla_writer(2, "rope_shift")
    with pytest.raises(KVABIError, match=r"^rope of layer .* element 0: .* not the value "
                                         r"written"):
        verify_quantized(layout, [cache], write)


def per_token_layout():
    """Keys and values per (block, token) as ``[K(H x D) | scale | V(H x D) | scale]``: one
    scale per token, shared by its heads."""
    rec = H * D + 4
    st = {"B": N * 2 * rec, "N": 2 * rec}
    return Layout(sizes={"B": B, "N": N, "H": H}, components=[
        Component(name="key", dtype="int8", count=D, strides={**st, "H": D, "E": 1}),
        Component(name="key_scale", dtype="float32", count=1, offset=H * D, strides=st),
        Component(name="value", dtype="int8", count=D, offset=rec,
                  strides={**st, "H": D, "E": 1}),
        Component(name="value_scale", dtype="float32", count=1, offset=rec + H * D,
                  strides=st)])


def test_a_scale_per_token_shared_by_heads():
    layout = per_token_layout()
    mem = np.zeros(layout.plane_size(0), np.uint8)
    rec = H * D + 4

    def write(layer, slots, key, value, per_head=False):
        for i, slot in enumerate(slots):
            base = int(slot) * 2 * rec
            for k, x in enumerate((key[i], value[i])):
                s = (np.abs(x).max(axis=-1 if per_head else None) / np.float32(127)
                     ).astype(np.float32)
                q = np.clip(np.rint(x / np.reshape(s, (-1, 1))), -127, 127).astype(np.int8)
                at = base + k * rec
                mem[at:at + H * D] = q.view(np.uint8).ravel()
                mem[at + H * D:at + rec] = np.float32(np.max(s)).reshape(1).view(np.uint8)

    assert verify_quantized(layout, [mem], write)["key_scale"] == 8
    with pytest.raises(KVABIError, match="not the code written"):
        verify_quantized(layout, [mem], lambda *a: write(*a, per_head=True))


def test_what_it_does_not_check_is_refused_by_name():
    with pytest.raises(KVABIError, match="int8 or float8 data"):
        verify_quantized(Layout.preset("vllm.cpu", SPEC, B), [np.zeros(1 << 16, np.uint8)],
                         lambda *a: None)
    cache, write = writer("int8")
    with pytest.raises(KVABIError, match="planes: .* has 1 planes, got 2"):
        verify_quantized(Layout.preset("vllm.int8_per_token_head", SPEC, B), [cache, cache],
                         write)


def test_a_writer_that_raises_is_reported_as_a_kvabi_error():
    cache, _ = writer("int8")

    def broken(layer, slots, key, value):
        raise IndexError("slot 99 out of range")

    with pytest.raises(KVABIError, match=r"^write: the engine's write raised IndexError: "
                                         r"slot 99") as info:
        verify_quantized(Layout.preset("vllm.int8_per_token_head", SPEC, B), [cache], broken)
    assert isinstance(info.value.__cause__, IndexError)
    assert not cache.any()


class _Unquantized(ReferenceBackend):
    name = "planted.unquantized"

    def capabilities(self, spec=None):
        return attrs.evolve(super().capabilities(spec), quant=("none",))


def test_a_backend_that_refuses_is_not_a_mismatch():
    spec = KVSpec(kind="full", block_size=N, num_kv_heads=H, head_dim=D, dtype="int8",
                  quant="per_token_head", rounding="nearest_away")
    layout = Layout.preset("vllm.int8_per_token_head", spec, B)
    planes, write = backend_writer(_Unquantized(), layout, spec)
    with pytest.raises(WriteRefused, match=r"^write_kv: planted.unquantized refused: .*quant "
                                           r"'per_token_head' not in \('none',\)"):
        verify_quantized(layout, planes, write)


def flashinfer_writer(kind, num_layers, fault=None):
    """FlashInfer's fp8 HND cache with one float32 scale per (token, head), from its two
    proposals: ``inline``, per layer ``[B, 2, H, N, D + 16]`` bytes with the scale at byte D
    of each slot; ``plane``, per layer a data plane ``[B, 2, H, N, D]`` and a scale plane
    ``[B, 2, H, N]`` float32.  Scales are absmax / 448, values divided, nearest e4m3."""
    slot = D + 16 if kind == "inline" else D
    data = [np.zeros((B, 2, H, N, slot), np.uint8) for _ in range(num_layers)]
    scale = [np.zeros((B, 2, H, N), np.float32) for _ in range(num_layers)]
    planes = data if kind == "inline" else [p for pair in zip(data, scale) for p in pair]

    def write(layer, slots, key, value):
        for kv, x in enumerate((key, value)):
            s = (np.abs(x).max(axis=-1) / np.float32(448)).astype(np.float32)  # [T, H]
            q = np.clip(x / s[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
            b, n = slots // N, slots % N
            d = data[layer][b, kv, :, n]  # [T, H, slot] (advanced indexing: a copy)
            d[..., :D] = q.view(np.uint8)
            if kind == "inline":
                at = D + 4 if fault == "scale_late" else D
                d[..., at:at + 4] = s.view(np.uint8).reshape(len(slots), H, 4)
            else:
                scale[layer][b, kv if fault != "scale_kv" else 1 - kv, :, n] = s
            data[layer][b, kv, :, n] = d
    return planes, write


@pytest.mark.parametrize("kind, name", [("inline", "flashinfer.HND.fp8_inline_scale"),
                                        ("plane", "flashinfer.HND.fp8_scale_plane")])
def test_flashinfer_fp8_scale_presets_against_a_writer_from_their_definition(kind, name):
    spec = KVSpec("full", N, H, D, dtype="float8_e4m3fn", quant="per_token_head")
    layout = Layout.preset(name, spec, B, 2)
    planes, write = flashinfer_writer(kind, 2)
    assert verify_quantized(layout, planes, write, samples=6)["key_scale"] == 6 * H
    planes, write = flashinfer_writer(kind, 2, "scale_late" if kind == "inline" else "scale_kv")
    with pytest.raises(KVABIError, match=r"^key_scale of layer \d, .* the scale .* is not at "
                                         r"plane \d+, byte \d+, where " + re.escape(name)):
        verify_quantized(layout, planes, write)
