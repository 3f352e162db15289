"""Transfer plans over components: between every pair of layouts of the same quantization
(values and scales), tokens and whole blocks move bit-exact there and back, no other byte
of the destination (padding, other blocks, guard bytes past the planes) changes; layouts of
another quantization are refused naming the field.  The oracle addresses every element
through ``Layout.element_offset`` (never through a plan)."""
from __future__ import annotations

import itertools

import attrs
import numpy as np
import pytest

from kvabi import Component, KVABIError, KVCache, KVSpec, Layout
from kvabi.util.dtypes import numpy_dtype
from kvabi.transfer import execute, plan_block_transfer, plan_transfer
from kvabi.transfer.host_pool import cross_layer_twin

GUARD = 64
SPEC = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")
MLA = KVSpec(kind="mla", block_size=4, num_kv_heads=1, head_dim=576, head_dim_v=512,
             dtype="bfloat16")
GROUPS = {  # layouts of one quantization: each may move to each
    "float16": (SPEC, ("vllm.LBHNC", "flash_attn", "tpu.combined", "vllm.cpu",
                       "vllm.cpu.BLHNC", "kvbm.fully_contiguous")),
    "fp8 + float32 per (token, head)": (SPEC, ("vllm.fp8_per_token_head",
                                               "flashinfer.HND.fp8_inline_scale",
                                               "flashinfer.HND.fp8_scale_plane")),
    "int8 + float32 per (token, head)": (SPEC, ("vllm.int8_per_token_head",)),
    "uint4 + float32 per (token, head)": (SPEC, ("vllm.int4_per_token_head",)),
    "fp8_ds_mla": (MLA, ("deepseek.fp8_ds_mla",)),
}


def layouts_of(group, block_size, num_blocks, num_layers=2):
    spec, names = GROUPS[group]
    spec = attrs.evolve(spec, block_size=block_size)
    out = [Layout.preset(n, spec, num_blocks, num_layers) for n in names]
    return out + [cross_layer_twin(out[0], num_blocks, num_layers)]


def buffers(layout, rng=None):
    """Per plane a byte buffer of the plane's size plus GUARD bytes, random (``rng``) or
    0xA5; the planes are flat arrays over them."""
    isz = layout.itemsize
    sizes = [-(-n // isz) * isz for n in layout.plane_sizes]
    bufs = [rng.integers(0, 256, n + GUARD, dtype=np.uint8) if rng is not None
            else np.full(n + GUARD, 0xA5, np.uint8) for n in sizes]
    if not layout.is_axis_form:
        return bufs, [b.view(numpy_dtype(layout.dtype))[:n // isz] for b, n in zip(bufs, sizes)]
    strides = [x * isz for x in layout.plane_strides]
    return bufs, [np.lib.stride_tricks.as_strided(b.view(f"u{isz}"), layout.plane_shape,
                                                  strides).view(numpy_dtype(layout.dtype))
                  for b in bufs]


def elements(layout, layers, slots):
    """name -> (plane, byte, nibble or -1) of every element of every component at
    (layers x slots), in one order for any layout of the same components."""
    bs = layout.size("N")
    out = {}
    for c in layout.components:
        ix = np.ix_(np.asarray(layers), np.asarray(slots),
                    np.arange(layout.size("H") if c.varies("H") else 1),
                    np.arange(c.count))
        lay, sl, h, e = ix
        if not c.varies("N"):
            sl = sl - sl % bs  # per-block data: the block's first slot names it
        p, o = layout.element_offset(c.name, layer=lay, block=sl // bs, token=sl % bs,
                                     head=h, index=e)
        nib = np.broadcast_to(e % 2 if c.units != c.count else -1, np.shape(o))
        out[c.name] = (np.broadcast_to(p, np.shape(o)), o, nib, c.unit)
    return out


def read(bufs, where):
    p, o, nib, unit = where
    got = np.empty(o.shape + (unit,), np.uint8)
    for q in np.unique(p):
        m = p == q
        got[m] = bufs[int(q)][o[m][:, None] + np.arange(unit)]
    if (nib >= 0).any():
        got = np.where(nib[..., None] == 1, got >> 4, got & 0xF)
    return got


def covered(bufs, where_all):
    masks = [np.zeros(b.size, bool) for b in bufs]
    for p, o, _, unit in where_all.values():
        for q in np.unique(p):
            m = p == q
            masks[int(q)][(o[m][:, None] + np.arange(unit)).ravel()] = True
    return masks


def check_moved(src, dst, layers, s, t, sbufs, dbufs, before):
    want = elements(src, layers, s)
    got = elements(dst, layers, t)
    for name in want:
        np.testing.assert_array_equal(read(dbufs, got[name]), read(sbufs, want[name]),
                                      err_msg=name)
    for b, old, m in zip(dbufs, before, covered(dbufs, got)):
        assert np.array_equal(b[~m], old[~m]), "a byte outside the moved elements changed"


def _pairs():
    for group in GROUPS:
        n = len(GROUPS[group][1]) + 1
        for a, b in itertools.product(range(n), repeat=2):
            yield pytest.param(group, a, b, id=f"{group}:{a}->{b}")


@pytest.mark.parametrize("group,a,b", list(_pairs()))
def test_round_trip_between_layouts_of_one_quantization(group, a, b):
    rng = np.random.default_rng(hash((group, a, b)) % 2**32)
    bs_s, bs_t = 4, 8
    src = layouts_of(group, bs_s, 6)[a]
    dst = layouts_of(group, bs_t, 4)[b]
    back = layouts_of(group, bs_s, 6)[a]
    layers = [0, 1]
    # whole blocks, then single tokens (not in order, across blocks)
    sb, db = np.array([5, 0, 3, 2]), np.array([1, 3])
    s = (sb[:, None] * bs_s + np.arange(bs_s)).ravel()
    t = (db[:, None] * bs_t + np.arange(bs_t)).ravel()
    for plan, ss, tt in ((plan_block_transfer(src, dst, sb, db), s, t),
                         (plan_transfer(src, dst, [7, 2, 21, 22], [9, 30, 4, 5],
                                        layers=[1]), [7, 2, 21, 22], [9, 30, 4, 5])):
        lay = layers if len(ss) == len(s) else [1]
        sbufs, splanes = buffers(src, rng)
        dbufs, dplanes = buffers(dst)
        before = [x.copy() for x in dbufs]
        execute(plan, KVCache.wrap(src, splanes), KVCache.wrap(dst, dplanes))
        check_moved(src, dst, lay, ss, tt, sbufs, dbufs, before)
        # and back, into a fresh cache of the source's layout: the source's bytes again
        rbufs, rplanes = buffers(back)
        rbefore = [x.copy() for x in rbufs]
        execute(plan_transfer(dst, back, tt, ss, layers=lay), KVCache.wrap(dst, dplanes),
                KVCache.wrap(back, rplanes))
        check_moved(src, back, lay, ss, ss, sbufs, rbufs, rbefore)


def test_records_move_as_one_region():
    """vLLM's per-token-head record (data and scales of keys and values) moves whole: one
    region per run of blocks, not four per (token, head)."""
    a = Layout.preset("vllm.int8_per_token_head", SPEC, 8, 2)
    b = Layout.preset("vllm.int8_per_token_head", SPEC, 6, 2)
    plan = plan_block_transfer(a, b, [2, 3, 4], [0, 1, 2])
    assert len(plan) == 2 and plan.nbytes == 2 * 3 * a.component("key").strides["B"]


@pytest.mark.parametrize("src,dst,field", [
    ("vllm.int8_per_token_head", "vllm.fp8_per_token_head", "dst_layout.dtype"),
    ("vllm.fp8_per_token_head", "vllm.LBHNC", "dst_layout.components.key_scale"),
])
def test_other_quantization_is_refused_by_field(src, dst, field):
    spec = SPEC if dst != "vllm.LBHNC" else attrs.evolve(SPEC, dtype="float8_e4m3fn")
    with pytest.raises(KVABIError, match=f"^{field}"):
        plan_transfer(Layout.preset(src, SPEC, 2), Layout.preset(dst, spec, 2), [0], [0])


def _per_block_scales():
    """fp8 keys and values with one float32 scale per (block, head) after each block."""
    n, h, d = 4, 2, 8
    blk = 2 * n * h * d + 2 * h * 4
    base = {"B": blk, "H": n * d}
    return Layout(sizes={"B": 2, "N": n, "H": h}, components=[
        Component(name="key", dtype="float8_e4m3fn", count=d,
                  strides={**base, "N": d, "E": 1}),
        Component(name="value", dtype="float8_e4m3fn", count=d, offset=n * h * d,
                  strides={**base, "N": d, "E": 1}),
        Component(name="key_scale", dtype="float32", count=1, offset=2 * n * h * d,
                  strides={"B": blk, "H": 4}),
        Component(name="value_scale", dtype="float32", count=1, offset=2 * n * h * d + h * 4,
                  strides={"B": blk, "H": 4})])


def test_scale_granularity_mismatch_is_refused():
    per_block = _per_block_scales()
    per_token = Layout.preset("vllm.fp8_per_token_head", SPEC, 2)
    with pytest.raises(KVABIError, match=r"^dst_layout\.components\.key_scale: per head of a "
                                         r"block, the source's is per \(token, head\)"):
        plan_transfer(per_token, per_block, [0], [0])
    with pytest.raises(KVABIError, match=r"^dst_layout\.components\.key_scale: the source "
                                         r"holds key_scale"):
        plan_transfer(per_token, Layout.preset("flashinfer.HND", attrs.evolve(
            SPEC, dtype="float8_e4m3fn"), 2), [0], [0])


def test_per_block_scales_move_with_whole_blocks_only():
    a = _per_block_scales()
    bufs, planes = buffers(a, np.random.default_rng(3))
    dbufs, dplanes = buffers(a)
    before = [x.copy() for x in dbufs]
    execute(plan_block_transfer(a, a, [1], [0]), KVCache.wrap(a, planes),
            KVCache.wrap(a, dplanes))
    check_moved(a, a, [0], np.arange(4, 8), np.arange(4), bufs, dbufs, before)
    with pytest.raises(KVABIError, match=r"^src_slots: key_scale is per block"):
        plan_transfer(a, a, [4, 5], [0, 1])
