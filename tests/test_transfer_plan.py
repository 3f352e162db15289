"""Copy plans: every logical element lands where ``Layout.byte_offset`` says (an independent
path), padding and untouched slots keep their poison, and region counts match the direct
formula for presets."""
from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvabi import KVABIError, KVSpec
from kvabi.layout.descriptor import Layout
from kvabi.layout.presets import AXIS_PRESETS, preset_names
from kvabi.testing.strategies import SMALL_BLOCK_SIZES, kv_specs, layouts
from kvabi.transfer import TransferPlan, execute, plan_block_transfer, plan_transfer
from transfer_oracle import POISON, check_moved, raw_planes


@st.composite
def layout_pairs(draw):
    """Two layouts of the same per-token data, block sizes drawn independently."""
    spec = draw(kv_specs(kinds=("full", "mla"), page_aligns=(1, 64)))
    spec2 = attrs.evolve(spec, block_size=draw(st.sampled_from(SMALL_BLOCK_SIZES)),
                         page_align=draw(st.sampled_from((1, 32))))
    nl = draw(st.integers(1, 3))
    src = draw(layouts(spec, draw(st.integers(1, 4)), nl))
    dst = draw(layouts(spec2, draw(st.integers(1, 4)), nl))
    return src, dst


#: the core property is cheap (milliseconds an example): run 8x the profile's examples
MANY = settings(max_examples=8 * settings().max_examples)


@MANY
@given(layout_pairs(), st.data())
def test_plan_moves_exactly_the_elements(pair, data):
    src, dst = pair
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    ns, nd = src.num_blocks * src.size("N"), dst.num_blocks * dst.size("N")
    m = data.draw(st.integers(0, min(ns, nd)))
    mode = data.draw(st.sampled_from(["random", "runs"]))
    t = rng.permutation(nd)[:m]
    if mode == "runs":  # consecutive slots: exercises merging of whole blocks and runs
        s0 = data.draw(st.integers(0, ns - m))
        t0 = data.draw(st.integers(0, nd - m))
        s, t = np.arange(s0, s0 + m), np.arange(t0, t0 + m)
    else:
        s = rng.integers(0, ns, m)  # sources may repeat
    layers = sorted(data.draw(st.sets(st.integers(0, src.num_layers - 1))))
    plan = plan_transfer(src, dst, s, t, layers=layers)
    sbufs, splanes = raw_planes(src, rng)
    dbufs, dplanes = raw_planes(dst, fill=POISON)
    before = [b.copy() for b in dbufs]
    assert execute(plan, splanes, dplanes) is dplanes
    isz = src.itemsize
    assert plan.nbytes == len(layers) * m * (2 if src.has_kv else 1) * src.size("H") \
        * src.size("D") * isz
    if layers and m:
        check_moved(src, dst, layers, s, t, sbufs, dbufs, before)
    else:
        assert len(plan) == 0
        assert all(np.array_equal(b, o) for b, o in zip(dbufs, before))


def _runs(sb, db):
    """Direct count of runs of blocks adjacent in both (blocks given in order)."""
    if not len(sb):
        return 0
    o = np.argsort(sb)
    sb, db = np.asarray(sb)[o], np.asarray(db)[o]
    return 1 + int(np.sum((np.diff(sb) != 1) | (np.diff(db) != 1)))


@MANY
@given(st.sampled_from(AXIS_PRESETS), st.data())
def test_region_count_formula(name, data):
    spec = KVSpec("full", block_size=data.draw(st.sampled_from((1, 4, 16))), num_kv_heads=2,
                  head_dim=128, dtype="bfloat16")
    nb, nl = 12, data.draw(st.integers(1, 4))
    lay = Layout.preset(name, spec, nb, nl)
    # Never the last block: layer l's last block is adjacent to layer l+1's first where L
    # lies outside B, and regions would (rightly) chain across layers.
    k = data.draw(st.integers(1, nb - 1))
    sb = data.draw(st.permutations(range(nb - 1)))[:k]
    db = data.draw(st.permutations(range(nb - 1)))[:k]
    if data.draw(st.booleans()):
        sb, db = sorted(sb), sorted(db)
    plan = plan_block_transfer(lay, lay, sb, db)
    outer = lay.num_planes * int(np.prod([lay.size(a) for a in
                                          lay.order[:lay.order.index("B")]]))
    assert len(plan) == _runs(sb, db) * outer
    if lay.is_block_contiguous and not lay.planes:  # cross-layer: one region per run
        assert len(plan) == _runs(sb, db)


def test_cross_layer_needs_32x_fewer_regions():
    spec = KVSpec("full", block_size=16, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    blocks = np.sort(np.random.default_rng(0).choice(1024, 128, replace=False))
    counts = {n: len(plan_block_transfer(L, L, blocks, blocks))
              for n in ("kvbm.fully_contiguous", "flashinfer.HND", "flash_attn")
              for L in [Layout.preset(n, spec, 1024, 32)]}
    runs = _runs(blocks, blocks)
    assert counts == {"kvbm.fully_contiguous": runs, "flashinfer.HND": 32 * runs,
                      "flash_attn": 64 * runs}


def test_relayout_falls_back_to_one_head():
    spec = KVSpec("full", block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    a = Layout.preset("flashinfer.HND", spec, 8, 2)
    b = Layout.preset("tpu.combined", attrs.evolve(spec, block_size=32), 4, 2)
    plan = plan_block_transfer(a, b, [0, 1], [3])
    # HND holds N inside H, tpu.combined H inside N, D padded to 128: one head's D each.
    assert len(plan) == 2 * 32 * 2 * 2 and set(plan.regions[:, 4]) == {64 * 2}


def test_mla_and_padding_never_copied():
    spec = KVSpec("mla", block_size=4, num_kv_heads=1, head_dim=8, dtype="float16")
    a = Layout.preset("vllm.BLNHC", spec, 4, 2)
    padded = attrs.evolve(a, extents={"D": 12}, name=None)
    plan = plan_block_transfer(a, padded, [0, 1], [2, 3])
    assert set(plan.regions[:, 4]) == {8 * 2}  # one latent vector each, padding skipped
    sbufs, sp = raw_planes(a, np.random.default_rng(1))
    dbufs, dp = raw_planes(padded)
    before = [b.copy() for b in dbufs]
    execute(plan, sp, dp)
    s = np.arange(8)
    check_moved(a, padded, [0, 1], s, s + 8, sbufs, dbufs, before)


# -- refusals ---------------------------------------------------------------------------
SPEC = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")
A = Layout.preset("flashinfer.NHD", SPEC, 4, 2)


@pytest.mark.parametrize("other, field", [
    (attrs.evolve(SPEC, num_kv_heads=4), "sizes.H"),
    (attrs.evolve(SPEC, head_dim=16, head_dim_v=16), "sizes.D"),
    (attrs.evolve(SPEC, dtype="bfloat16"), "dtype"),
    (KVSpec("mla", block_size=4, num_kv_heads=1, head_dim=8, dtype="float16"), "sizes.KV"),
])
def test_refuses_different_data(other, field):
    b = Layout.preset("kvbm.fully_contiguous", other, 4, 2)
    with pytest.raises(KVABIError, match=field):
        plan_transfer(A, b, [0], [0])


@pytest.mark.parametrize("kwargs, match", [
    (dict(src_slots=[0, 1], dst_slots=[0]), "dst_slots: 1 slots"),
    (dict(src_slots=[0, 1], dst_slots=[3, 3]), "dst_slots: slot 3 appears twice"),
    (dict(src_slots=[16], dst_slots=[0]), "src_slots: values must be <= 15"),
    (dict(src_slots=[-1], dst_slots=[0]), "src_slots: values must be >= 0"),
    (dict(src_slots=[0.0], dst_slots=[0]), "src_slots: must hold integers"),
    (dict(src_slots=[True], dst_slots=[0]), "src_slots: must hold integers"),
    (dict(src_slots=[0], dst_slots=[0], layers=[2]), "layers: layer 2 is not in"),
    (dict(src_slots=[0], dst_slots=[0], layers=[1.0]), "layers: must hold integers"),
])
def test_refuses_bad_input(kwargs, match):
    with pytest.raises(KVABIError, match=match):
        plan_transfer(A, A, **kwargs)


@pytest.mark.parametrize("last", [Fraction(5, 2), Decimal("2.5"), 2.5, None])
@pytest.mark.parametrize("form", [list, lambda xs: np.array(xs, dtype=object)])
def test_every_slot_is_checked(last, form):
    """The last of 1,001 slots is checked as the first is: never planned as slot 2."""
    b = Layout.preset("flashinfer.NHD", SPEC, 300, 2)
    src = list(range(1000)) + [last]
    with pytest.raises(KVABIError, match="^src_slots: must hold integers"):
        plan_transfer(b, b, form(src), list(range(1001)))
    with pytest.raises(KVABIError, match="^dst_slots: must hold integers"):
        plan_transfer(b, b, list(range(1001)), form(src))


def test_repeated_destination_blocks_are_named_as_blocks():
    with pytest.raises(KVABIError, match="^dst_blocks: block 2 appears twice"):
        plan_block_transfer(A, A, [0, 1], [2, 2])
    with pytest.raises(KVABIError, match="^dst_blocks: block 1 appears twice"):
        plan_block_transfer(A, A, [0, 0, 3], [1, 2, 1])


def test_layer_counts_must_match_or_be_named():
    b = Layout.preset("flashinfer.NHD", SPEC, 4, 3)
    with pytest.raises(KVABIError, match="layers: the source has 2 layers"):
        plan_transfer(A, b, [0], [0])
    assert plan_transfer(A, b, [0], [0], layers=[1]).nbytes == 2 * 8 * 2 * 2


def test_block_shorthand_refuses_unequal_tokens():
    b = Layout.preset("flashinfer.NHD", attrs.evolve(SPEC, block_size=8), 4, 2)
    with pytest.raises(KVABIError, match="dst_blocks"):
        plan_block_transfer(A, b, [0], [0])
    assert plan_block_transfer(A, b, [0, 1], [3]).nbytes == 2 * 8 * 2 * 2 * 8 * 2


def test_check_refuses_regions_outside_planes():
    plan = plan_block_transfer(A, A, [0], [1])
    assert plan.check() is plan
    with pytest.raises(KVABIError, match=r"regions\[0\]: src bytes"):
        plan.check(src_nbytes=plan.regions[0, 1] + 1)
    with pytest.raises(KVABIError, match="dst plane 1 out of range"):
        plan.check(dst_nbytes=[A.plane_nbytes])
    bad = plan.regions.copy()
    bad[0, 4] = -5
    with pytest.raises(KVABIError, match="nbytes must be > 0"):
        TransferPlan(bad, A, A).check()
    two = np.concatenate([plan.regions[:1], plan.regions[:1]])
    with pytest.raises(KVABIError, match="overlap"):
        TransferPlan(two, A, A).check()
    with pytest.raises(KVABIError, match="int64 array"):
        TransferPlan(plan.regions.astype(np.int32), A, A).check()


def test_presets_cover_mla():
    spec = KVSpec("mla", block_size=4, num_kv_heads=1, head_dim=8, dtype="bfloat16")
    for name in preset_names(spec):
        lay = Layout.preset(name, spec, 6, 2)
        plan = plan_block_transfer(lay, lay, [1, 2], [4, 5])
        assert plan.nbytes == 2 * 2 * 4 * 8 * 2
