"""The component presets, pinned byte for byte against independent writers written here
from each format's published definition (vLLM's ``triton_attn.py`` per-token-head content,
vLLM's CPU_ATTN block-head tiles, FlashInfer's inline and separate-scale proposals,
DeepSeek V3.2's 656-byte record in vLLM's ``flashmla_sparse.py``), and a planted fault in
each writer (one scale moved, K and V swapped, a nibble order flipped) caught by the same
check.  vLLM's own writers pin ``vllm.cpu`` (integrations/vllm/tests/test_cpu_layout.py)."""
from __future__ import annotations

import numpy as np
import pytest

from kvabi import KVCache, KVSpec, Layout
from kvabi.layout.presets import PRESETS, preset_names
from kvabi.layout.presets_components import CPU, QUANTIZED

L, B, N, H, D = 2, 3, 4, 2, 8
RNG = np.random.default_rng(7)
SPEC = KVSpec(kind="full", block_size=N, num_kv_heads=H, head_dim=D, dtype="float16")
MLA = KVSpec(kind="mla", block_size=N, num_kv_heads=1, head_dim=576, head_dim_v=512,
             dtype="bfloat16")


def rand_bytes(*shape):
    return RNG.integers(0, 256, shape, dtype=np.uint8)


def pack(nibbles, flipped=False):
    """Two 4-bit values per byte, element 2i low (high when ``flipped``)."""
    lo, hi = nibbles[..., 0::2], nibbles[..., 1::2]
    return ((hi << 4) | lo if not flipped else (lo << 4) | hi).astype(np.uint8)


def truth(count, unit, packed=False):
    """Random element bytes [L, B, N, H, count * unit] (packed: [.., count / 2] bytes of
    nibbles) and, packed, the nibbles."""
    if packed:
        nib = RNG.integers(0, 16, (L, B, N, H, count), dtype=np.uint8)
        return pack(nib), nib
    return rand_bytes(L, B, N, H, count * unit), None


def check(layout, planes, want: dict) -> int:
    """Elements whose bytes differ between the layout's view of ``planes`` and ``want``
    (name -> [L, B, N, H, bytes])."""
    cache = KVCache.wrap(layout, planes)
    bad = 0
    for name, w in want.items():
        for layer in range(L):
            v = cache.component_view(name, layer)
            got = np.ascontiguousarray(v).view(np.uint8).reshape(w[layer].shape)
            bad += int(np.count_nonzero(got != w[layer]))
    return bad


# -- vLLM per-token-head: [L, B, H, N, 2 * (data + 4)] of [K | K_scale | V | V_scale] ------
def per_token_head_writer(data, fault=None):
    packed = data == "uint4"
    dbytes = D // 2 if packed else D
    k, knib = truth(D, 1, packed)
    v, vnib = truth(D, 1, packed)
    ks = RNG.standard_normal((L, B, N, H, 1)).astype(np.float32).view(np.uint8)
    vs = RNG.standard_normal((L, B, N, H, 1)).astype(np.float32).view(np.uint8)
    half = dbytes + 4
    t = np.zeros((L, B, H, N, 2 * half), np.uint8)
    kk, vv = (v, k) if fault == "swap" else (k, v)
    if fault == "nibbles":
        kk = pack(knib, flipped=True)
    t[..., :dbytes] = kk.transpose(0, 1, 3, 2, 4)
    t[..., half:half + dbytes] = vv.transpose(0, 1, 3, 2, 4)
    at = 0 if fault == "scale" else dbytes  # planted: the key scale before the key
    if fault == "scale":
        t[..., 4:dbytes + 4] = kk.transpose(0, 1, 3, 2, 4)
    t[..., at:at + 4] = ks.transpose(0, 1, 3, 2, 4)
    t[..., half + dbytes:] = vs.transpose(0, 1, 3, 2, 4)
    return [t.reshape(-1)], {"key": k, "value": v, "key_scale": ks, "value_scale": vs}


@pytest.mark.parametrize("name,data", [("vllm.int8_per_token_head", "int8"),
                                       ("vllm.fp8_per_token_head", "float8_e4m3fn"),
                                       ("vllm.int4_per_token_head", "uint4")])
def test_per_token_head_pinned(name, data):
    lay = Layout.preset(name, SPEC, B, L)
    assert lay.component("key").dtype == data and lay.component("key_scale").dtype == "float32"
    planes, want = per_token_head_writer(data)
    assert lay.plane_sizes == (planes[0].nbytes,)
    assert check(lay, planes, want) == 0
    # spot check against the content definition directly
    rec = 2 * ((D // 2 if data == "uint4" else D) + 4)
    assert lay.element_offset("value_scale", layer=1, block=2, token=3, head=1) == \
        (0, ((1 * B + 2) * H + 1) * N * rec + 3 * rec + rec - 4)
    for fault in ("scale", "swap") + (("nibbles",) if data == "uint4" else ()):
        planes, want = per_token_head_writer(data, fault)
        assert check(lay, planes, want) > 0, fault


# -- vLLM CPU_ATTN: per block and head [2N, D]: keys transposed [D, N], then values [N, D] --
def cpu_writer(order, fault=None):
    k, v = (RNG.standard_normal((L, B, N, H, D)).astype(np.float16) for _ in range(2))
    sizes = {"L": L, "B": B, "H": H}
    t = np.zeros([sizes[a] for a in order] + [2 * N, D], np.float16)
    for l_ in range(L):
        for b in range(B):
            for h in range(H):
                idx = tuple({"L": l_, "B": b, "H": h}[a] for a in order)
                tile = t[idx]  # [2N, D] as the kernels view a block-head
                keys = (v if fault == "swap" else k)[l_, b, :, h]
                tile[:N] = keys.T.reshape(N, D) if fault != "untransposed" else keys
                tile[N:] = (k if fault == "swap" else v)[l_, b, :, h]
    return [t.reshape(-1).view(np.uint8)], {"key": k.view(np.uint8), "value": v.view(np.uint8)}


@pytest.mark.parametrize("name", sorted(CPU))
def test_vllm_cpu_pinned(name):
    lay = Layout.preset(name, SPEC, B, L)
    order = CPU[name]
    planes, want = cpu_writer(order)
    assert lay.plane_sizes == (planes[0].nbytes,) and check(lay, planes, want) == 0
    for fault in ("swap", "untransposed"):
        planes, want = cpu_writer(order, fault)
        assert check(lay, planes, want) > 0, fault


def test_vllm_cpu_states_fp8_and_page_alignment():
    fp8 = Layout.preset("vllm.cpu", KVSpec(kind="full", block_size=N, num_kv_heads=H,
                                           head_dim=D, dtype="float8_e4m3fn"), B, L)
    assert fp8.dtype == "float8_e4m3fn" and fp8.plane_sizes == (L * B * H * 2 * N * D,)
    padded = Layout.preset("vllm.cpu", KVSpec(kind="full", block_size=N, num_kv_heads=H,
                                              head_dim=D, dtype="float16", page_align=1024),
                           B, L)
    assert padded.component("key").strides["B"] == 1024
    assert padded.byte_offset(layer=1, block=2, kv=1, token=3, head=1, dim=5) == \
        (0, (1 * B + 2) * 1024 + 1 * 2 * N * D * 2 + N * D * 2 + (3 * D + 5) * 2)


# -- FlashInfer proposals: HND per layer, scale inline in a 16-byte slot or its own plane ---
def flashinfer_writer(kind, fault=None):
    k, v = rand_bytes(L, B, N, H, D), rand_bytes(L, B, N, H, D)
    ks, vs = (RNG.standard_normal((L, B, N, H, 1)).astype(np.float32).view(np.uint8)
              for _ in range(2))
    if fault == "swap":
        k, v = v, k
    want = {"key": k, "value": v, "key_scale": ks, "value_scale": vs}
    hnd = lambda x: x.transpose(0, 1, 3, 2, 4)  # noqa: E731  [L, B, H, N, .]
    if kind == "inline":
        t = np.zeros((L, B, 2, H, N, D + 16), np.uint8)
        t[:, :, 0, ..., :D], t[:, :, 1, ..., :D] = hnd(k), hnd(v)
        at = D + 12 if fault == "scale" else D  # planted: scale at the slot's end
        t[:, :, 0, ..., at:at + 4], t[:, :, 1, ..., D:D + 4] = hnd(ks), hnd(vs)
        planes = [t[i].reshape(-1) for i in range(L)]
    else:
        data = np.zeros((L, B, 2, H, N, D), np.uint8)
        sc = np.zeros((L, B, 2, H, N, 4), np.uint8)
        data[:, :, 0], data[:, :, 1] = hnd(k), hnd(v)
        sc[:, :, 0], sc[:, :, 1] = hnd(ks), hnd(vs)
        if fault == "scale":  # planted: the scale plane in NHD order
            sc[:, :, 0] = ks.reshape(L, B, H, N, 4)
        planes = [p for i in range(L) for p in (data[i].reshape(-1), sc[i].reshape(-1))]
    if fault == "swap":
        want["key"], want["value"] = v, k
    return planes, want


@pytest.mark.parametrize("name,kind", [("flashinfer.HND.fp8_inline_scale", "inline"),
                                       ("flashinfer.HND.fp8_scale_plane", "plane")])
def test_flashinfer_scale_proposals_pinned(name, kind):
    lay = Layout.preset(name, SPEC, B, L)
    planes, want = flashinfer_writer(kind)
    assert lay.plane_sizes == tuple(p.nbytes for p in planes)
    assert check(lay, planes, want) == 0
    for fault in ("scale", "swap"):
        planes, want = flashinfer_writer(kind, fault)
        assert check(lay, planes, want) > 0, fault


# -- DeepSeek V3.2 fp8_ds_mla: 656-byte token records --------------------------------------
def deepseek_writer(fault=None):
    lat = rand_bytes(L, B, N, 1, 512)
    sc = RNG.standard_normal((L, B, N, 1, 4)).astype(np.float32).view(np.uint8)
    rope = RNG.standard_normal((L, B, N, 1, 64)).astype(np.float32).astype(
        np.dtype("float16")).view(np.uint8)  # any 2-byte values stand for bf16 bytes
    t = np.zeros((L, B, N, 656), np.uint8)
    t[..., :512] = lat[:, :, :, 0]
    order = [1, 0, 2, 3] if fault == "scale" else [0, 1, 2, 3]  # planted: scales 0, 1 swapped
    t[..., 512:528] = sc[:, :, :, 0].reshape(L, B, N, 4, 4)[..., order, :].reshape(L, B, N, 16)
    t[..., 528:] = rope[:, :, :, 0]
    return [t.reshape(-1)], {"latent": lat, "latent_scale": sc, "rope": rope}


def test_deepseek_fp8_ds_mla_pinned():
    lay = Layout.preset("deepseek.fp8_ds_mla", MLA, B, L)
    assert [(c.name, c.dtype, c.count, c.offset) for c in lay.components] == [
        ("latent", "float8_e4m3fn", 512, 0), ("rope", "bfloat16", 64, 528),
        ("latent_scale", "float32", 4, 512)]
    assert lay.component("latent").strides["N"] == 656 and lay.size("D") == 576
    planes, want = deepseek_writer()
    assert check(lay, planes, want) == 0
    planes, want = deepseek_writer("scale")
    assert check(lay, planes, want) > 0
    assert lay.byte_offset(block=1, token=2, dim=512) == (0, (N + 2) * 656 + 528)


def test_quantized_presets_are_asked_for_by_name():
    assert not set(QUANTIZED) & set(preset_names(SPEC))
    assert set(CPU) <= set(preset_names(SPEC)) and not set(CPU) & set(preset_names(
        KVSpec(kind="mla", block_size=N, num_kv_heads=1, head_dim=16, dtype="float16")))
    assert set(CPU) | set(QUANTIZED) <= set(PRESETS)


@pytest.mark.parametrize("name", sorted(set(QUANTIZED) | set(CPU)))
def test_component_presets_round_trip(name):
    spec = MLA if name.startswith("deepseek") else SPEC
    lay = Layout.preset(name, spec, B, L)
    assert Layout.from_json(lay.to_json()) == lay and not lay.is_axis_form
