"""Local execution of plans on numpy, torch and jax caches, and the host pool; the oracle is
per-element reads through ``kv_view`` / ``byte_offset``."""
from __future__ import annotations

import sys

import attrs
import numpy as np
import pytest

from kvabi import KVABIError, KVCache, KVSpec
from kvabi.layout.descriptor import Layout
from kvabi.layout.presets import AXIS_PRESETS
from kvabi.transfer import HostPool, execute, plan_block_transfer, plan_transfer
from transfer_oracle import POISON, element_bytes, gather, raw_planes, written_mask

SPEC = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")


def _kv(cache, layer, kv):
    """Logical [B, N, H, D] values of a cache, as float32 numpy (oracle read path)."""
    if cache.framework == "jax":
        planes = KVCache.wrap(cache.layout, [np.asarray(p) for p in cache])
        return np.asarray(planes.kv_view(layer, kv)).astype(np.float32)
    v = cache.kv_view(layer, kv)
    if cache.framework == "torch":
        import torch

        return v.to(torch.float32).numpy()
    return np.asarray(v).astype(np.float32)


def _tokens(cache, slots, layer, kv):
    v = _kv(cache, layer, kv)
    bs = cache.layout.size("N")
    slots = np.asarray(slots)
    return v[slots // bs, slots % bs]


def _filled(layout, framework, seed):
    rng = np.random.default_rng(seed)
    _, planes = raw_planes(layout, rng)
    # random bytes may be NaN patterns: tests compare bit patterns, never values
    c = KVCache.wrap(layout, planes)
    if framework == "numpy":
        return c
    if framework == "torch":
        import torch

        out = KVCache.allocate(layout, "torch", fill=0)
        for p, q in zip(planes, out):  # bytes as they are (bf16 through uint16)
            q.copy_(torch.from_numpy(np.ascontiguousarray(p).view(np.uint16)).view(
                torch.bfloat16))
        return out
    import jax.numpy as jnp

    return c.replace([jnp.asarray(np.ascontiguousarray(p)) for p in planes]) \
        if layout.is_c_contiguous else None


@pytest.mark.parametrize("src_fw, dst_fw", [("numpy", "torch"), ("torch", "torch"),
                                            ("torch", "numpy"), ("numpy", "jax"),
                                            ("jax", "numpy"), ("jax", "jax")])
def test_frameworks(src_fw, dst_fw):
    pytest.importorskip("torch")
    if "jax" in (src_fw, dst_fw):
        pytest.importorskip("jax")
    a = Layout.preset("flashinfer.HND", SPEC, 6, 2)
    b = Layout.preset("tpu.combined", attrs.evolve(SPEC, block_size=8), 4, 2)
    src = _filled(a, src_fw, 0)
    dst = KVCache.allocate(b, dst_fw, fill=0)
    s = np.array([0, 1, 2, 3, 9, 10, 21, 5])
    t = np.array([31, 0, 1, 2, 3, 8, 9, 17])
    plan = plan_transfer(a, b, s, t)
    out = execute(plan, src, dst)
    if dst_fw == "jax":
        assert out is not dst and isinstance(out, KVCache) and out.layout is b
    else:
        assert out is dst
    for layer in range(2):
        for kv in range(2):
            got = _tokens(out, t, layer, kv)
            want = _tokens(src, s, layer, kv)
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
            untouched = np.setdiff1d(np.arange(32), t)
            assert not _tokens(out, untouched, layer, kv).any()


def test_numpy_bytes_of_many_small_regions_one_gather():
    # A relayout of a whole cache: thousands of one-head regions through one gather.
    spec = KVSpec("full", block_size=16, num_kv_heads=4, head_dim=32, dtype="float16")
    a = Layout.preset("flashinfer.HND", spec, 16, 4)
    b = Layout.preset("tpu.combined", attrs.evolve(spec, block_size=64), 4, 4)
    plan = plan_block_transfer(a, b, np.arange(16), np.arange(4))
    assert len(plan) == 4 * 256 * 2 * 4
    rng = np.random.default_rng(3)
    sbufs, sp = raw_planes(a, rng)
    dbufs, dp = raw_planes(b, fill=POISON)
    execute(plan, sp, dp)
    s = np.arange(256)
    ap, ao = element_bytes(a, range(4), s)
    bp, bo = element_bytes(b, range(4), s)
    assert np.array_equal(gather(dbufs, bp, bo, 2), gather(sbufs, ap, ao, 2))
    pad = np.ones(dbufs[0].size, bool)
    for p in range(4):
        m = bp == p
        pad[(bo[m][:, None] + np.arange(2)).ravel()] = False
        assert (dbufs[p][pad] == POISON).all()  # D padding (32 -> 128) untouched
        pad[:] = True


def test_large_regions_copied_as_slices(monkeypatch):
    mod = sys.modules["kvabi.transfer.execute"]  # the module (the package exports the function)
    monkeypatch.setattr(mod, "LARGE", 64)
    calls = []
    real = mod._gather_scatter
    monkeypatch.setattr(mod, "_gather_scatter", lambda *a: calls.append(1) or real(*a))
    a = Layout.preset("kvbm.fully_contiguous", SPEC, 8, 2)
    plan = plan_block_transfer(a, a, [0, 1, 2, 5], [4, 5, 6, 0])
    src = _filled(a, "numpy", 5)
    dst = KVCache.allocate(a, "numpy")
    execute(plan, src, dst)
    assert not calls  # every region was large: sliced, no gather
    for layer in range(2):
        for kv in range(2):
            np.testing.assert_array_equal(_kv(dst, layer, kv)[[4, 5, 6, 0]].view(np.uint32),
                                          _kv(src, layer, kv)[[0, 1, 2, 5]].view(np.uint32))


def test_execute_refuses_mismatched_caches():
    a = Layout.preset("flashinfer.HND", SPEC, 6, 2)
    b = Layout.preset("flashinfer.NHD", SPEC, 6, 2)
    plan = plan_block_transfer(a, b, [0], [1])
    with pytest.raises(KVABIError, match="dst: cache"):
        execute(plan, KVCache.allocate(a), KVCache.allocate(a).planes[:1])
    small = [np.zeros(3, np.float16)] * 2
    with pytest.raises(KVABIError, match="src"):
        execute(plan, small, KVCache.allocate(b))
    with pytest.raises(KVABIError, match="plan: must be a TransferPlan"):
        execute(plan.regions, KVCache.allocate(a), KVCache.allocate(b))
    bogus = attrs.evolve(plan, regions=plan.regions + np.array([0, a.plane_nbytes, 0, 0, 0]))
    dst = KVCache.allocate(b, fill=0)
    with pytest.raises(KVABIError, match="outside plane"):
        execute(bogus, KVCache.allocate(a, fill=1), dst)
    assert not any(p.any() for p in dst)  # nothing written before the check failed


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_host_pool_round_trip(framework):
    pytest.importorskip(framework)
    a = Layout.preset("flashinfer.HND", SPEC, 8, 3)
    cache = _filled(a, framework, 7)
    pool = HostPool(a, 6)
    assert pool.layout.name == "kvbm.fully_contiguous" and pool.num_free == 6
    ids = pool.offload(cache, [5, 2, 3])
    assert list(ids) == [0, 1, 2] and pool.num_free == 3
    fresh = KVCache.allocate(a, framework, fill=0)
    assert pool.onload(fresh, ids, [0, 1, 7]) is fresh
    for layer in range(3):
        for kv in range(2):
            np.testing.assert_array_equal(_kv(fresh, layer, kv)[[0, 1, 7]].view(np.uint32),
                                          _kv(cache, layer, kv)[[5, 2, 3]].view(np.uint32))
            assert not _kv(fresh, layer, kv)[2:7].any()
    pool.free(ids[:1])
    with pytest.raises(KVABIError, match="host_ids: block 0 holds no offloaded data"):
        pool.onload(fresh, [0], [0])
    with pytest.raises(KVABIError, match="blocks: 5 blocks to offload, the host pool has 4 free"):
        pool.offload(cache, [0, 1, 2, 3, 4])
    with pytest.raises(KVABIError, match="cache: must be a KVCache"):
        pool.offload(list(cache), [0])


def test_host_pool_from_spec_and_other_preset():
    pool = HostPool(SPEC, 4, num_layers=2, preset="kvbm.layer_separate")
    assert pool.layout.num_layers == 2 and pool.layout.name == "kvbm.layer_separate"
    with pytest.raises(KVABIError, match="source: must be a Layout or a KVSpec"):
        HostPool("flashinfer.HND", 4)
    with pytest.raises(KVABIError, match="num_blocks"):
        HostPool(SPEC, 0)


@pytest.mark.gpu
def test_cuda_caches():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    a = Layout.preset("flashinfer.HND", SPEC, 6, 2)
    b = Layout.preset("tpu.combined", attrs.evolve(SPEC, block_size=8), 4, 2)
    host = _filled(a, "torch", 11)
    src = KVCache.wrap(a, [p.cuda() for p in host])
    dst = KVCache.allocate(b, "torch", device="cuda")
    s, t = np.array([0, 1, 2, 3, 9]), np.array([8, 9, 10, 11, 30])
    assert execute(plan_transfer(a, b, s, t), src, dst) is dst
    back = KVCache.wrap(b, [p.cpu() for p in dst])
    for layer in range(2):
        for kv in range(2):
            np.testing.assert_array_equal(_tokens(back, t, layer, kv).view(np.uint32),
                                          _tokens(host, s, layer, kv).view(np.uint32))


@pytest.mark.parametrize("name", AXIS_PRESETS)
def test_cross_layer_host_pool_moves_whole_blocks(name):
    """The twin host layout keeps the device's byte order: offload regions are whole
    (layer, block) ranges of the device, merged across runs of blocks."""
    a = Layout.preset(name, SPEC, 8, 3)
    pool = HostPool(a, 5, preset="cross_layer")
    assert pool.layout.order[0] == "B" and not pool.layout.planes
    blocks = [6, 1, 2, 3]
    plan = plan_block_transfer(a, pool.layout, blocks, [0, 1, 2, 3])
    if not a.extents:  # never splits a device (layer, block) range (padding would)
        split = a.num_planes * int(np.prod([a.size(x) for x in a.order[:a.order.index("B")]]))
        assert len(plan) <= len(blocks) * split
        if a.is_block_contiguous and not a.planes:  # cross-layer device: one per run
            assert len(plan) == 2
    cache = _filled(a, "numpy", 9)
    ids = pool.offload(cache, blocks)
    fresh = KVCache.allocate(a, "numpy")
    pool.onload(fresh, ids, [0, 4, 5, 7])
    for layer in range(3):
        for kv in range(2):
            np.testing.assert_array_equal(_kv(fresh, layer, kv)[[0, 4, 5, 7]].view(np.uint32),
                                          _kv(cache, layer, kv)[blocks].view(np.uint32))
    with pytest.raises(KVABIError, match="preset: 'cross_layer' is built from a device Layout"):
        HostPool(SPEC, 4, num_layers=2, preset="cross_layer")


@pytest.mark.parametrize("reverse", [False, True])
def test_regular_regions_fold_into_boxes(reverse, monkeypatch):
    """Strided regions (a relayout of whole blocks, or a reversed token order: negative
    destination strides) are copied as boxes; the bytes match the oracle either way."""
    spec = KVSpec("full", block_size=8, num_kv_heads=2, head_dim=4, dtype="float32")
    a = Layout.preset("flashinfer.HND", spec, 4, 2)
    b = Layout.preset("vllm.BLNHC", attrs.evolve(spec, block_size=16), 2, 2)
    s = np.arange(16)
    t = np.arange(16, 32)[::-1] if reverse else np.arange(16, 32)
    plan = plan_transfer(a, b, s, t)
    mod = sys.modules["kvabi.transfer.execute"]
    r = plan.regions[plan.regions[:, 0] == 0]
    # atoms of one head's D, and (in order) a few pairs merged across block ends
    assert set(r[:, 4]) <= {16, 32}
    if reverse:  # nothing merges: the sequence is regular as it is
        _, _, shape, _, ds = mod.fold(r[:, 1], r[:, 3])
        assert shape and min(ds) < 0
    boxes = []
    real = mod._copy_boxes
    monkeypatch.setattr(mod, "_copy_boxes", lambda *a: boxes.append(a[2]) or real(*a))
    monkeypatch.setattr(mod, "_gather_scatter", None)  # must not be needed
    rng = np.random.default_rng(4)
    sbufs, sp = raw_planes(a, rng)
    dbufs, dp = raw_planes(b)
    before = [x.copy() for x in dbufs]
    execute(plan, sp, dp)
    assert len(boxes) == 2 and all(boxes), "each source plane copied as boxes"
    ap, ao = element_bytes(a, [0, 1], s)
    bp, bo = element_bytes(b, [0, 1], t)
    assert np.array_equal(gather(dbufs, bp, bo, 4), gather(sbufs, ap, ao, 4))
    for buf, old, m in zip(dbufs, before, written_mask(dbufs, bp, bo, 4)):
        assert np.array_equal(buf[~m], old[~m])


def test_fold():
    fold = sys.modules["kvabi.transfer.execute"].fold
    assert fold(np.array([0, 8, 16, 40]), np.array([0, 8, 16, 24]))[2] == []
    starts_s, starts_d, shape, ss, ds = fold(np.array([0, 8, 100, 108]),
                                             np.array([0, 16, 200, 216]))
    assert (shape, ss, ds) == ([2, 2], [100, 8], [200, 16])
    assert list(starts_s) == [0] and list(starts_d) == [0]
    starts_s, _, shape, ss, ds = fold(np.array([0, 8, 100, 108, 150, 158]),
                                      np.array([0, 16, 200, 216, 300, 316]))
    assert (shape, ss, ds) == ([2], [8], [16]) and list(starts_s) == [0, 100, 150]
