"""Whole-block plans (one sub-block's regions broadcast over the blocks) and their strided
execution: the regions equal those of the general planner for the same tokens, and every
logical element lands where ``Layout.byte_offset`` says (the oracle), with padding and
untouched bytes keeping their poison, on numpy, torch and jax caches and through the host
pool."""
from __future__ import annotations

import math
import sys

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvabi import KVABIError, KVCache, KVSpec
from kvabi.layout.descriptor import Layout
from kvabi.testing.strategies import SMALL_BLOCK_SIZES, kv_specs, layouts
from kvabi.transfer import HostPool, execute, plan_block_transfer, plan_transfer
from kvabi.transfer.pattern import GroupedPattern, block_strides
from transfer_oracle import POISON, check_moved, raw_planes

MANY = settings(max_examples=4 * settings().max_examples)


@st.composite
def block_moves(draw):
    """Two layouts of the same per-token data (block sizes drawn independently), distinct
    source and destination blocks holding the same tokens, and layers."""
    spec = draw(kv_specs(kinds=("full", "mla"), page_aligns=(1, 64)))
    spec2 = attrs.evolve(spec, block_size=draw(st.sampled_from(SMALL_BLOCK_SIZES)),
                         page_align=draw(st.sampled_from((1, 32))))
    bs_s, bs_t = spec.block_size, spec2.block_size
    g = math.lcm(bs_s, bs_t)
    groups = draw(st.integers(1, 3))
    ns, nt = groups * g // bs_s, groups * g // bs_t
    nl = draw(st.integers(1, 3))
    src = draw(layouts(spec, ns + draw(st.integers(0, 3)), nl))
    dst = draw(layouts(spec2, nt + draw(st.integers(0, 3)), nl))
    sb = draw(st.permutations(range(src.num_blocks)))[:ns]
    db = draw(st.permutations(range(dst.num_blocks)))[:nt]
    if draw(st.booleans()):  # runs of adjacent blocks: exercises merging and long runs
        sb, db = sorted(sb), sorted(db)
    layers = sorted(draw(st.sets(st.integers(0, nl - 1), min_size=1)))
    return src, dst, np.array(sb), np.array(db), layers


def _slots(blocks, bs):
    return (np.asarray(blocks)[:, None] * bs + np.arange(bs)).ravel()


@MANY
@given(block_moves(), st.integers(0, 2**32 - 1))
def test_block_plan_equals_general_plan_and_moves_exactly(move, seed):
    src, dst, sb, db, layers = move
    plan = plan_block_transfer(src, dst, sb, db, layers=layers)
    s, t = _slots(sb, src.size("N")), _slots(db, dst.size("N"))
    general = plan_transfer(src, dst, s, t, layers=layers)
    u = math.gcd(src.size("N"), dst.size("N"))
    # one pattern where every component of a layout steps alike along B (and along N where
    # sub-blocks split blocks), else one per group of components that do
    shifted = block_strides(src, u) is not None and block_strides(dst, u) is not None
    assert plan.pattern is not None and general.pattern is None
    assert isinstance(plan.pattern, GroupedPattern) != shifted
    np.testing.assert_array_equal(plan.regions, general.regions)
    assert plan.check() is plan
    rng = np.random.default_rng(seed)
    sbufs, splanes = raw_planes(src, rng)
    dbufs, dplanes = raw_planes(dst, fill=POISON)
    before = [b.copy() for b in dbufs]
    assert execute(plan, splanes, dplanes) is dplanes  # the strided path
    check_moved(src, dst, layers, s, t, sbufs, dbufs, before)


@MANY
@given(block_moves(), st.integers(0, 2**32 - 1))
def test_host_pool_of_random_layouts(move, seed):
    """offload/onload (templates kept per layout, no regions) through the oracle: the
    device's blocks come back bit for bit, other device bytes keep their poison."""
    src, _, sb, _, _ = move
    pool = HostPool(src, sb.size + 1, layout=None)
    rng = np.random.default_rng(seed)
    sbufs, splanes = raw_planes(src, rng)
    cache = KVCache.wrap(src, splanes)
    ids = pool.offload(cache, sb)
    back = rng.permutation(src.num_blocks)[:sb.size]
    dbufs, dplanes = raw_planes(src, fill=POISON)
    before = [b.copy() for b in dbufs]
    fresh = KVCache.wrap(src, dplanes)
    assert pool.onload(fresh, ids, back) is fresh
    layers = range(src.num_layers)
    check_moved(src, src, layers, _slots(sb, src.size("N")), _slots(back, src.size("N")),
                 sbufs, dbufs, before)


def _bytes_of(cache):
    """Raw bytes of each plane (numpy, torch or jax), for bit comparisons."""
    out = []
    for p in cache:
        if cache.framework == "torch":
            import torch

            out.append(p.contiguous().view(torch.uint8).numpy().ravel().copy())
        else:
            out.append(np.ascontiguousarray(np.asarray(p)).view(np.uint8).ravel())
    return out


@pytest.mark.parametrize("src_fw, dst_fw", [("numpy", "torch"), ("torch", "torch"),
                                            ("torch", "numpy"), ("numpy", "jax"),
                                            ("jax", "jax")])
@pytest.mark.parametrize("reverse", [False, True])
def test_frameworks(src_fw, dst_fw, reverse):
    """The strided path on every framework, including destination blocks in decreasing
    order (negative steps: torch views cannot have them, so runs are split there); the
    expectation is the same move on numpy through the general planner's regions."""
    torch = pytest.importorskip("torch")
    if "jax" in (src_fw, dst_fw):
        jnp = pytest.importorskip("jax.numpy")

    spec = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    a = Layout.preset("flashinfer.HND", spec, 8, 2)
    sb = np.array([1, 2, 3, 6])
    if reverse:
        b = Layout.preset("tpu.combined", spec, 8, 2)
        db = np.array([7, 6, 5, 4])
    else:
        b = Layout.preset("tpu.combined", attrs.evolve(spec, block_size=8), 5, 2)
        db = np.array([4, 1])
    plan = plan_block_transfer(a, b, sb, db)
    runs = sys.modules["kvabi.transfer.pattern_copy"].runs
    steps = [t for _, n, _, t in runs(plan.pattern.src_base, plan.pattern.dst_base) if n > 1]
    assert reverse == any(t < 0 for t in steps)
    rng = np.random.default_rng(1)
    _, planes = raw_planes(a, rng)
    want = KVCache.allocate(b, "numpy", fill=0)
    execute(attrs.evolve(plan), KVCache.wrap(a, planes), want)  # regions path
    bits = [np.ascontiguousarray(p).view(np.uint16) for p in planes]
    if src_fw == "torch":
        src = KVCache.wrap(a, [torch.from_numpy(x.copy()).view(torch.bfloat16) for x in bits])
    elif src_fw == "jax":
        src = KVCache.wrap(a, [jnp.asarray(x).view(jnp.bfloat16) for x in bits])
    else:
        src = KVCache.wrap(a, planes)
    dst = KVCache.allocate(b, dst_fw, fill=0)
    out = execute(plan, src, dst)
    assert (out is dst) == (dst_fw != "jax")
    for got, exp in zip(_bytes_of(out), _bytes_of(want)):
        np.testing.assert_array_equal(got, exp)


def test_runs_cover_each_sub_block_once_with_constant_steps():
    runs = sys.modules["kvabi.transfer.pattern_copy"].runs
    rng = np.random.default_rng(0)
    for _ in range(200):
        m = int(rng.integers(1, 30))
        bs = np.cumsum(rng.choice([1, 1, 1, 2, 5], m)) * 64
        bt = np.cumsum(rng.choice([1, 1, -3], m)) * 32
        got = runs(bs, bt)
        covered = []
        for i, n, a, b in got:
            covered += range(i, i + n)
            np.testing.assert_array_equal(bs[i:i + n], bs[i] + a * np.arange(n))
            np.testing.assert_array_equal(bt[i:i + n], bt[i] + b * np.arange(n))
        assert covered == list(range(m))
    # adjacent blocks stay together after a lone jump
    assert runs(np.array([0, 2, 3, 4]), np.array([0, 2, 3, 4])) == [(0, 1, 0, 0), (1, 3, 1, 1)]


def test_block_plan_regions_are_read_only_and_evolve_drops_the_pattern():
    spec = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    a = Layout.preset("flashinfer.HND", spec, 4, 2)
    plan = plan_block_transfer(a, a, [0, 1], [2, 3])
    with pytest.raises(ValueError):
        plan.regions[0, 1] = 10**9  # the pattern's proof covers these rows only
    bogus = attrs.evolve(plan, regions=plan.regions + np.array([0, a.plane_nbytes, 0, 0, 0]))
    assert bogus.pattern is None
    with pytest.raises(KVABIError, match=r"regions\[0\]: src bytes .* outside plane"):
        bogus.check()
    with pytest.raises(KVABIError, match=r"regions\[\d+\]: dst bytes .* outside plane 0"):
        plan.check(dst_nbytes=[a.plane_nbytes - 1, a.plane_nbytes])


def test_a_pattern_run_without_regions_is_bounds_checked():
    """execute_pattern (the host pool's path) runs a pattern without its regions: a pattern
    whose bases reach past the planes is refused before any byte moves."""
    from kvabi.transfer.execute import execute_pattern

    spec = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    a = Layout.preset("flashinfer.HND", spec, 4, 2)
    pat = plan_block_transfer(a, a, [0, 1], [2, 3]).pattern
    _, src = raw_planes(a, np.random.default_rng(0))
    for side in ("src_base", "dst_base"):
        for shift in (a.plane_nbytes, -a.plane_nbytes):
            bufs, dst = raw_planes(a)
            evil = attrs.evolve(pat, **{side: getattr(pat, side) + shift})
            with pytest.raises(KVABIError, match="^pattern: a sub-block reaches outside"):
                execute_pattern(evil, a, a, src, dst)
            assert all((b == POISON).all() for b in bufs)
    bufs, dst = raw_planes(a)
    execute_pattern(pat, a, a, src, dst)  # the pattern as built moves its bytes
    assert not all((b == POISON).all() for b in bufs)


def test_host_pool_refuses_repeated_or_mismatched_blocks():
    spec = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    a = Layout.preset("flashinfer.HND", spec, 6, 2)
    pool = HostPool(a, 4)
    cache = KVCache.allocate(a, fill=1)
    ids = pool.offload(cache, [0, 1])
    with pytest.raises(KVABIError, match="blocks: block 3 appears twice"):
        pool.onload(cache, ids, [3, 3])
    with pytest.raises(KVABIError, match="blocks: 1 blocks of 4 tokens do not hold 2 blocks"):
        pool.onload(cache, ids, [3])


def test_host_pool_keeps_few_templates():
    """Equal layouts share a template (an engine rebuilding its Layout does not grow the
    pool), and the pool keeps at most TEMPLATES of them."""
    mod = sys.modules["kvabi.transfer.host_pool"]
    spec = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    pool = HostPool(Layout.preset("flashinfer.HND", spec, 6, 2), 4)
    for _ in range(3):
        cache = KVCache.allocate(Layout.preset("flashinfer.HND", spec, 6, 2), fill=1)
        pool.onload(cache, pool.offload(cache, [1, 2]), [3, 4])
        pool.free([0, 1])
    assert len(pool._templates) == 2  # offload and onload
    for n in range(6, 6 + mod.TEMPLATES):
        cache = KVCache.allocate(Layout.preset("flashinfer.HND", spec, n, 2), fill=1)
        pool.free(pool.offload(cache, [0]))
    assert len(pool._templates) == mod.TEMPLATES


@pytest.mark.gpu
def test_cuda_block_plan():
    """The strided path on CUDA tensors (views over device memory), against the numpy run
    of the general planner's regions."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    spec = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    a = Layout.preset("flashinfer.HND", spec, 8, 2)
    b = Layout.preset("tpu.combined", attrs.evolve(spec, block_size=8), 5, 2)
    plan = plan_block_transfer(a, b, [1, 2, 3, 6], [4, 1])
    _, planes = raw_planes(a, np.random.default_rng(2))
    want = KVCache.allocate(b, "numpy", fill=0)
    execute(attrs.evolve(plan), KVCache.wrap(a, planes), want)
    src = KVCache.wrap(a, [torch.from_numpy(np.ascontiguousarray(p).view(np.uint16)).view(
        torch.bfloat16).cuda() for p in planes])
    dst = KVCache.allocate(b, "torch", device="cuda", fill=0)
    assert execute(plan, src, dst) is dst
    for got, exp in zip(dst, want):
        np.testing.assert_array_equal(got.cpu().view(torch.int16).numpy(),
                                      np.ascontiguousarray(exp).view(np.int16))
