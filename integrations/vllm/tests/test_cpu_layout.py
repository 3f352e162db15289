"""The byte order of vLLM's CPU attention cache, pinned against the kernels' own write.

Oracles: the formula stated in ``kvabi_vllm.cpu_layout`` (keys transposed per block and
head, values token-major) and ``Layout.byte_offset`` of kvabi layouts; never the copy
under test."""
import numpy as np
import pytest
import torch

import kvabi
from kvabi import KVSpec, Layout

from kvabi_vllm.cpu_layout import choose_isa, kernel_scratch, to_kernel_blocks

ops = pytest.importorskip("vllm._custom_ops")

CASES = [("float32", 32, 64), ("float16", 64, 128), ("bfloat16", 16, 80), ("float32", 48, 112),
         ("bfloat16", 128, 32)]


def _distinct(dtype, n, start):
    """n values of ``dtype`` with distinct, finite bit patterns (exact in a copy)."""
    bits = torch.arange(start, start + n, dtype=torch.int32)
    if dtype == torch.float32:
        return bits.float()
    return bits.to(torch.int16).view(dtype)  # < 0x7C00: finite in float16 and bfloat16


def _kernel_write(dtype, bs, hd, heads=2, blocks=3, slots=None):
    """A kernel-order cache written by ``cpu_attn_reshape_and_cache``; the K/V written."""
    n = blocks * bs * heads * hd
    k = _distinct(dtype, n, 1).reshape(blocks * bs, heads, hd)
    v = _distinct(dtype, n, n + 1).reshape(blocks * bs, heads, hd)
    scratch, kc, vc = kernel_scratch(torch, blocks, heads, bs, hd, dtype)
    scratch.zero_()
    if slots is None:
        slots = torch.arange(blocks * bs, dtype=torch.int64)
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, choose_isa(hd, bs))
    return scratch, k, v


@pytest.mark.parametrize("dtype,bs,hd", CASES)
def test_kernel_write_puts_keys_transposed_and_values_token_major(dtype, bs, hd):
    dt = getattr(torch, dtype)
    heads, blocks = 2, 3
    scratch, k, v = _kernel_write(dt, bs, hd, heads, blocks)
    u = torch.int32 if dt == torch.float32 else torch.int16
    tile = scratch.view(u).reshape(blocks, heads, 2, bs * hd).numpy()
    b, t, h, d = np.meshgrid(np.arange(blocks), np.arange(bs), np.arange(heads),
                             np.arange(hd), indexing="ij")
    kb, vb = k.view(u).numpy(), v.view(u).numpy()
    np.testing.assert_array_equal(tile[b, h, 0, d * bs + t], kb[b * bs + t, h, d])
    np.testing.assert_array_equal(tile[b, h, 1, t * hd + d], vb[b * bs + t, h, d])


def test_vllm_lbhnc_does_not_describe_the_kernels_bytes():
    """vLLM names this cache LBHNC; the kernels' keys are not where that layout says."""
    bs, hd, heads, blocks = 32, 64, 2, 3
    scratch, k, _ = _kernel_write(torch.float32, bs, hd, heads, blocks)
    spec = KVSpec("full", block_size=bs, num_kv_heads=heads, head_dim=hd, dtype="float32")
    for name in ("vllm.LBHNC", "flashinfer.HND"):
        layout = Layout.preset(name, spec, num_blocks=blocks)
        held = kvabi.KVCache.wrap(layout, [scratch.reshape(layout.plane_shape)])
        assert not torch.equal(held.kv_view(0, 0).reshape(-1, heads, hd), k), name


@pytest.mark.parametrize("name", ["vllm.LBHNC", "flashinfer.HND", "flash_attn"])
@pytest.mark.parametrize("dtype,bs,hd", CASES)
def test_copy_into_kernel_order_equals_the_kernels_own_write(name, dtype, bs, hd):
    """A kvabi cache written at ``Layout.byte_offset`` (numpy oracle) and copied by
    ``to_kernel_blocks`` holds the bytes the kernel writes itself, block order permuted."""
    dt = getattr(torch, dtype)
    heads, blocks = 2, 3
    spec = KVSpec("full", block_size=bs, num_kv_heads=heads, head_dim=hd, dtype=dtype)
    layout = Layout.preset(name, spec, num_blocks=blocks, num_layers=2)
    perm = torch.tensor([2, 0, 1])  # entry e holds cache block perm[e]
    scratch, k, v = _kernel_write(dt, bs, hd, heads, blocks)
    # Oracle placement: every element at its byte offset in raw planes.
    u = torch.int32 if dt == torch.float32 else torch.int16
    npu = np.int32 if u == torch.int32 else np.int16
    raw = [np.zeros(layout.plane_nbytes // layout.itemsize, npu)
           for _ in range(layout.num_planes)]
    e, t, h, d = np.meshgrid(np.arange(blocks), np.arange(bs), np.arange(heads),
                             np.arange(hd), indexing="ij")
    for kv, src in ((0, k), (1, v)):
        plane, off = layout.byte_offset(layer=1, block=perm.numpy()[e], kv=kv, token=t,
                                        head=h, dim=d)
        vals = src.view(u).numpy()[e * bs + t, h, d]
        for p in range(layout.num_planes):
            sel = plane == p
            raw[p][off[sel] // layout.itemsize] = vals[sel]
    planes = [torch.from_numpy(r).view(dt) for r in raw]
    planes = [torch.as_strided(p, layout.plane_shape, layout.plane_strides) for p in planes]
    cache = kvabi.KVCache.wrap(layout, planes)
    got, _, _ = kernel_scratch(torch, blocks, heads, bs, hd, dt)
    to_kernel_blocks(cache.kv_view(1, 0), cache.kv_view(1, 1), perm, got)
    assert torch.equal(got.view(torch.uint8), scratch.view(torch.uint8))


def test_hidden_value_rows_are_zeroed_and_others_kept():
    bs, hd, heads = 16, 32, 1
    spec = KVSpec("full", block_size=bs, num_kv_heads=heads, head_dim=hd, dtype="float32")
    layout = Layout.preset("flashinfer.HND", spec, num_blocks=2)
    cache = kvabi.KVCache.allocate(layout, "torch")
    cache.kv_view(0, 0).fill_(float("nan"))
    cache.kv_view(0, 1).fill_(float("inf"))
    hidden = torch.zeros((2, bs), dtype=torch.bool)
    hidden[1, 5:] = True
    s, kc, vc = kernel_scratch(torch, 2, heads, bs, hd, torch.float32)
    e, n = torch.nonzero(hidden, as_tuple=True)
    to_kernel_blocks(cache.kv_view(0, 0), cache.kv_view(0, 1), torch.tensor([0, 1]), s,
                     (e * heads + 0) * 2 * bs + bs + n)
    kt = kc.reshape(2, heads, hd, bs)
    assert torch.isnan(kt).all()  # keys are masked by select in the kernels: copied as is
    assert torch.isinf(vc[1, :, :5]).all() and (vc[1, :, 5:] == 0).all()
    assert torch.isnan(kt[0]).all() and torch.isinf(vc[0]).all()
