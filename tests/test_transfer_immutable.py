"""Checked once, safe at every use: plans and patterns cannot be changed after their check,
a plan rebuilt with mutated regions is refused (or stays inside the destination), and planes
changed under a handle are refused at use.

Every destination plane sits between two guard zones of poisoned bytes inside one buffer:
whatever a mutated plan asks, the guards keep their poison, and a refused call leaves the
destination untouched.  A few hundred examples in the ``ci`` profile; 10,000 in
``thorough`` (``make thorough``).
"""
from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvabi import KVABIError, KVCache, KVSpec
from kvabi.util.dtypes import numpy_dtype
from kvabi.layout.descriptor import Layout
from kvabi.testing.profiles import current_profile
from kvabi.transfer import HostPool, execute, plan_block_transfer, plan_transfer
from transfer_oracle import POISON

EXAMPLES = 10_000 if current_profile() == "thorough" else 300
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SPEC = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
PRESETS = ("flashinfer.HND", "flashinfer.NHD", "kvbm.fully_contiguous", "tpu.combined",
           "flash_attn")
GUARD = 256  # poisoned bytes on each side of a destination plane


def guarded(layout: Layout):
    """(buffers, planes): each plane over the middle of a buffer poisoned everywhere."""
    isz = layout.itemsize
    bufs, planes = [], []
    for _ in range(layout.num_planes):
        buf = np.full(GUARD + layout.plane_nbytes + GUARD, POISON, np.uint8)
        raw = buf[GUARD:GUARD + layout.plane_nbytes].view(np.dtype(f"u{isz}"))
        p = np.lib.stride_tricks.as_strided(raw, layout.plane_shape,
                                            [s * isz for s in layout.plane_strides])
        planes.append(p.view(numpy_dtype(layout.dtype)))
        bufs.append(buf)
    return bufs, KVCache.wrap(layout, planes)


def source(layout: Layout, seed: int) -> KVCache:
    c = KVCache.allocate(layout, "numpy")
    rng = np.random.default_rng(seed)
    for p in c:
        p[...] = rng.standard_normal(p.shape).astype(p.dtype)
    return c


def guards_intact(bufs) -> bool:
    return all((b[:GUARD] == POISON).all() and (b[-GUARD:] == POISON).all() for b in bufs)


@st.composite
def plans(draw):
    a = Layout.preset(draw(st.sampled_from(PRESETS)), SPEC, 6, 2)
    bs = draw(st.sampled_from([4, 8]))
    b = Layout.preset(draw(st.sampled_from(PRESETS)), attrs.evolve(SPEC, block_size=bs),
                      24 // bs, 2)
    if draw(st.booleans()):  # whole blocks: a plan with a pattern
        n = draw(st.integers(1, 24 // bs))
        db = draw(st.permutations(range(24 // bs)))[:n]
        sb = draw(st.permutations(range(6)))[:n * bs // 4]
        plan = plan_block_transfer(a, b, sb, db)
    else:
        k = draw(st.integers(1, 12))
        s = draw(st.lists(st.integers(0, 23), min_size=k, max_size=k))
        t = draw(st.permutations(range(24)))[:k]
        plan = plan_transfer(a, b, s, t)
    return plan


#: a mutation: one row, one column, a new value (extremes included)
values = st.one_of(st.integers(-2**40, 2**40), st.sampled_from([-1, 0, 1, 2**62, -2**63,
                                                               2**63 - 1]))


@FUZZ
@given(plans(), st.data())
def test_mutated_plans_are_refused_or_stay_inside(plan, data):
    before = plan.regions.copy()
    # In place: nothing of a checked plan can change.
    with pytest.raises((ValueError, TypeError)):
        plan.regions[0, 3] = 0
    with pytest.raises(ValueError):
        plan.regions.flags.writeable = True
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        plan.regions = before
    if plan.pattern is not None:
        for name in ("src_base", "dst_base", "template", "dst_slots"):
            with pytest.raises(ValueError):
                getattr(plan.pattern, name)[0] = 10**9
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            plan.pattern.dst_base = plan.pattern.dst_base + 1
    assert np.array_equal(plan.regions, before)
    # A new plan of mutated regions: refused before any byte moves, or inside the planes.
    mutated = before.copy()
    if len(mutated):
        row = data.draw(st.integers(0, len(mutated) - 1))
        col = data.draw(st.integers(0, 4))
        mutated[row, col] = data.draw(values)
    evil = attrs.evolve(plan, regions=mutated)
    assert evil.pattern is None
    bufs, dst = guarded(plan.dst_layout)
    try:
        execute(evil, source(plan.src_layout, 0), dst)
    except KVABIError:
        assert all((b == POISON).all() for b in bufs)  # refused: nothing written
    assert guards_intact(bufs)
    # The original plan still runs, inside its planes.
    bufs, dst = guarded(plan.dst_layout)
    execute(plan, source(plan.src_layout, 0), dst)
    assert guards_intact(bufs)


@settings(max_examples=max(EXAMPLES // 10, 30), deadline=None)
@given(plans(), st.sampled_from(["read-only", "same", "overlap"]))
def test_planes_changed_under_a_handle_are_refused(plan, how):
    src = source(plan.src_layout, 1)
    bufs, dst = guarded(plan.dst_layout)
    if how == "read-only":
        dst[len(dst) - 1].flags.writeable = False
        with pytest.raises(KVABIError, match=rf"dst\[{len(dst) - 1}\]: the numpy plane is "
                                             "read-only"):
            execute(plan, src, dst)
    else:
        if plan.src_layout != plan.dst_layout:
            return
        other = dst if how == "same" else KVCache.wrap(plan.dst_layout, list(dst))
        r = plan.regions.tolist()
        # oracle, pair by pair: a region writes bytes that some region reads
        clash = any(dp == sp and do < so + sn and so < do + dn
                    for sp, so, _, _, sn in r for _, _, dp, do, dn in r)
        before = [bytes(b) for b in bufs]
        if clash:
            with pytest.raises(KVABIError, match=r"regions\[\d+\]: its destination bytes are "
                                                 "also read"):
                execute(plan, other, dst)
            assert [bytes(b) for b in bufs] == before  # refused before any byte moved
            return
        execute(plan, other, dst)  # one cache, disjoint regions: a plain copy
        for sp, so, dp, do, n in r:
            assert bufs[dp][GUARD + do:GUARD + do + n].tobytes() == \
                before[sp][GUARD + so:GUARD + so + n]
        assert all(b[:GUARD].tobytes() == o[:GUARD] and b[-GUARD:].tobytes() == o[-GUARD:]
                   for b, o in zip(bufs, before))
        return
    assert all((b == POISON).all() for b in bufs)


def test_torch_planes_changed_after_wrap():
    torch = pytest.importorskip("torch")
    a = Layout.preset("flashinfer.HND", SPEC, 6, 2)
    plan = plan_block_transfer(a, a, [0, 1], [2, 3])
    src = KVCache.allocate(a, "torch", fill=1)
    dst = KVCache.allocate(a, "torch")
    dst[1].set_(torch.zeros(4))  # a smaller storage after the handle was made
    with pytest.raises(KVABIError, match=r"dst: cache\[1\]: the plane changed after "
                                         r"KVCache.wrap checked it"):
        execute(plan, src, dst)
    meta = [torch.empty(p.shape, device="meta").as_strided(p.shape, p.stride()) for p in src]
    with pytest.raises(KVABIError, match=r"cache\[0\]\.device: a meta tensor holds no memory"):
        KVCache.wrap(a, meta)  # refused where memory enters; execute checks plain lists itself
    with pytest.raises(KVABIError, match=r"dst: cache\[0\]\.device: a meta tensor holds no memory"):
        execute(plan, src, meta)
    with pytest.raises(KVABIError, match=r"src: cache\[0\]\.device: a meta tensor holds no memory"):
        execute(plan, meta, KVCache.allocate(a, "torch"))
    for p in src:
        p.copy_(torch.randn(p.shape))
    execute(plan, src, src)  # blocks 0, 1 -> 2, 3 of one cache: disjoint bytes, a plain copy
    assert all(bool((p[2:4] == p[0:2]).all()) and not bool((p[4] == p[0]).all()) for p in src)
    with pytest.raises(KVABIError, match=r"regions\[\d+\]: its destination bytes are also read"):
        execute(plan_block_transfer(a, a, [0, 1], [1, 2]), src, src)


def test_host_pool_refusals():
    a = Layout.preset("flashinfer.HND", SPEC, 6, 2)
    with pytest.raises(KVABIError, match=r"num_blocks: 1099511627776 host blocks need \d+ "
                                         r"bytes, more than this machine's"):
        HostPool(a, 2**40)
    pool = HostPool(a, 4)
    ids = pool.offload(source(a, 2), [0, 1])
    bufs, dst = guarded(a)
    for p in dst:
        p.flags.writeable = False
    with pytest.raises(KVABIError, match=r"dst\[0\]: the numpy plane is read-only"):
        pool.onload(dst, ids, [2, 3])
    assert all((b == POISON).all() for b in bufs)
