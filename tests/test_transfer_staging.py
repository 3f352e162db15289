"""Staged pulls without a transfer engine: the spans a plan's source regions are read as,
and the local regions that copy out of the staging buffer, checked against the plan's own
regions byte by byte (a simulated READ: each span copied from random source planes)."""
from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvabi import KVCache, KVSpec
from kvabi.util.dtypes import numpy_dtype
from kvabi.layout.descriptor import Layout
from kvabi.transfer import execute, plan_block_transfer, plan_transfer
from kvabi.transfer.execute import byte_view, copy_from_staging
from kvabi.transfer.pattern import GroupedPattern
from kvabi.transfer.staging import GAP, stage, stage_blocks

SPEC = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
PRESETS = ("flashinfer.HND", "flashinfer.NHD", "kvbm.fully_contiguous", "tpu.combined",
           "flash_attn")


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(PRESETS), st.sampled_from(PRESETS), st.data())
def test_spans_cover_every_region(a_name, b_name, data):
    a = Layout.preset(a_name, SPEC, 6, 2)
    b = Layout.preset(b_name, attrs.evolve(SPEC, block_size=8), 3, 2)
    k = data.draw(st.integers(1, 24))
    s = data.draw(st.lists(st.integers(0, 23), min_size=k, max_size=k))  # repeats allowed
    t = data.draw(st.permutations(range(24)))[:k]
    plan = plan_transfer(a, b, s, t)
    r = plan.regions
    st_ = stage(r)
    rng = np.random.default_rng(0)
    planes = [rng.integers(0, 256, a.plane_nbytes, dtype=np.uint8) for _ in range(a.num_planes)]
    buf = np.zeros(st_.nbytes, np.uint8)
    for (p, off, n), at in zip(st_.spans.tolist(), st_.at.tolist()):
        assert 0 <= off and off + n <= a.plane_nbytes and at + n <= st_.nbytes
        buf[at:at + n] = planes[p][off:off + n]  # the simulated READ
    # spans are disjoint in the staging buffer, and fewer than the regions where they join
    order = np.argsort(st_.at)
    ends = st_.at[order] + st_.spans[order, 2]
    assert np.all(st_.at[order][1:] >= ends[:-1])
    assert len(st_.spans) <= len(r)
    # every local region reads from staging exactly the bytes its plan region names
    local = st_.local
    assert np.array_equal(np.sort(local[:, 2:], axis=0), np.sort(r[:, 2:], axis=0))
    want = {(int(x[2]), int(x[3])): planes[int(x[0])][x[1]:x[1] + x[4]].tobytes() for x in r}
    for _, lo, dp, do, n in local.tolist():
        assert buf[lo:lo + n].tobytes() == want[(dp, do)]


def test_spans_join_near_regions_only():
    """Two tokens of one block (pieces a few bytes apart) are one span per plane; two tokens
    blocks apart (more than GAP bytes) are two."""
    a = Layout.preset("flashinfer.HND", SPEC, 64, 2)
    assert 63 * a.stride("B") > GAP + a.stride("B")
    near = stage(plan_transfer(a, a, [0, 1], [0, 5]).regions)
    far = stage(plan_transfer(a, a, [0, 63 * 4], [0, 5]).regions)
    assert len(near.spans) == a.num_planes and len(far.spans) == 2 * a.num_planes


BLOCK_PAIRS = [("flashinfer.HND", 4, "tpu.combined", 8), ("vllm.cpu", 4, "vllm.cpu.BLHNC", 8),
               ("vllm.cpu", 8, "vllm.cpu.BLHNC", 4), ("vllm.cpu", 4, "flashinfer.NHD", 4),
               ("vllm.cpu.BLHNC", 4, "vllm.cpu", 4)]


@pytest.mark.parametrize("a_name,bs_a,b_name,bs_b", BLOCK_PAIRS)
def test_staged_blocks_equal_the_direct_copy(a_name, bs_a, b_name, bs_b):
    """A staged whole-block pull (the source cut to the blocks touched, READ in its own
    byte order, then strided copies out of the staging buffer) writes exactly what a direct
    execute of the plan writes; vLLM's CPU cache (keys and values shifting differently per
    sub-block) takes the grouped pattern."""
    a = Layout.preset(a_name, attrs.evolve(SPEC, block_size=bs_a), 24 // bs_a * 2, 2)
    b = Layout.preset(b_name, attrs.evolve(SPEC, block_size=bs_b), 24 // bs_b, 2)
    sb = np.array([5, 1, 2, 4, 0, 3])[:24 // bs_a]
    db = np.random.default_rng(1).permutation(24 // bs_b)
    plan = plan_block_transfer(a, b, sb, db)
    src = _filled(a)
    want = execute(plan, src, KVCache.allocate(b))
    piece = stage_blocks(plan.pattern, a, b, [])
    assert piece is not None
    lay, n = piece.layout, piece.layout.plane_nbytes
    buf = np.zeros(lay.num_planes * n, np.uint8)
    for sp, so, dp, do, nb in piece.pull.check().regions.tolist():  # the simulated READ
        buf[dp * n + do:dp * n + do + nb] = byte_view(src[sp], a)[so:so + nb]
    got = KVCache.allocate(b)
    piece.local.check(np.full(lay.num_planes, n), np.asarray(b.plane_sizes))
    copy_from_staging([buf[i * n:(i + 1) * n] for i in range(lay.num_planes)], None,
                      piece.local, lay, got, got)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(byte_view(x, b), byte_view(y, b))
    assert isinstance(plan.pattern, GroupedPattern) == (a_name.startswith("vllm.cpu") and
                                                        bs_a != bs_b)


def _filled(layout):
    planes = [np.random.default_rng(3 + i).integers(0, 256, layout.plane_nbytes, np.uint8)
              for i in range(layout.num_planes)]
    isz = layout.itemsize
    return KVCache.wrap(layout, [np.lib.stride_tricks.as_strided(
        p.view(f"u{isz}"), layout.plane_shape, [s * isz for s in layout.plane_strides])
        .view(numpy_dtype(layout.dtype)) for p in planes])


def test_staging_chosen_only_where_it_saves_descriptors():
    """A pull between shardings is staged where staging joins its regions into a few spans
    (each prefill rank of TP 2 holds its heads of a block contiguously), direct where
    every region stays a span of its own (a decode rank of TP 2 reading half the heads of
    each block of a TP 1 prefill: gaps of the other heads between the regions)."""
    from kvabi.model.shard import Shard
    from kvabi.transfer.shards import plan_shard_transfer
    from kvabi.transfer.staging import staging_pays, worth_staging

    spec = attrs.evolve(SPEC, block_size=16, num_kv_heads=8, head_dim=128, head_dim_v=128)

    def ranks(tp, blocks):
        return [attrs.evolve(Layout.preset("flashinfer.HND", attrs.evolve(
            spec, num_kv_heads=8 // tp), blocks, 4), shard=Shard.tp(r, tp, 8))
            for r in range(tp)]

    slots = np.arange(64 * 16)

    def choice(plan):
        out = []
        for _, part in plan.parts:
            st = stage(part.regions)
            assert worth_staging(part.regions)  # 16 KiB regions: small enough to consider
            out.append(staging_pays(len(part), len(st.spans), int(st.spans[:, 2].sum())))
        return out

    assert choice(plan_shard_transfer(ranks(2, 64), ranks(1, 64)[0], slots, slots)) == \
        [True, True]
    assert choice(plan_shard_transfer(ranks(1, 64), ranks(2, 64)[0], slots, slots)) == [False]
    # a relayout of many small regions read as a few spans: staged
    a = Layout.preset("flashinfer.HND", spec, 64, 4)
    plan = plan_transfer(a, Layout.preset("flashinfer.NHD", spec, 64, 4), slots, slots)
    st = stage(plan.regions)
    assert staging_pays(len(plan), len(st.spans), int(st.spans[:, 2].sum()))
