"""Plans between shardings over component layouts (keys placed apart from values, scale
components, vLLM's CPU cache, DeepSeek's fp8 MLA record), executed locally: prefill TP x
decode TP in {1, 2, 4}^2 x {GQA, fewer KV heads than ranks (replicated), MLA} x layout
pairs (component <-> axis form, component <-> component, cross-layer twins) x block sizes
larger and smaller on either side.  Every unit of every component (values and scales) at
the destination equals the model's record of its global head (``shard_oracle``: written
and read through ``Layout.element_offset`` from the shard definition, never through a
plan), every other byte keeps its poison; what the math does not allow (another
quantization, a record shared by heads that would be assembled from several ranks) is
refused by field before any plan exists."""
from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvabi import Component, KVABIError, KVSpec, Layout
from kvabi.model.shard import Shard
from kvabi.transfer.host_pool import cross_layer_twin
from kvabi.transfer.shards import (execute_shards, plan_shard_block_transfer,
                                   plan_shard_transfer, plan_tp_transfer)
from shard_oracle import (check_components, component_cache, component_model,
                          shared_scale_group, shared_scale_layout, table, write_components)

LAYERS = 2
DIM = 8
KINDS = {"gqa": 4, "replicated": 2}  # global KV heads (TP 4 holds 2 heads twice)
#: layout pairs (prefill, decode) of one quantization; "xl:" is the preset's cross-layer
#: twin (B outermost, each component dense per (block, layer))
PAIRS = [("vllm.cpu", "flashinfer.HND"), ("flashinfer.NHD", "vllm.cpu.BHLNC"),
         ("vllm.cpu.LHBNC", "xl:vllm.cpu"),
         ("vllm.fp8_per_token_head", "flashinfer.HND.fp8_scale_plane"),
         ("flashinfer.HND.fp8_inline_scale", "xl:vllm.fp8_per_token_head"),
         ("vllm.int8_per_token_head", "xl:vllm.int8_per_token_head"),
         ("vllm.int4_per_token_head", "vllm.int4_per_token_head")]
MLA_PAIRS = [("deepseek.fp8_ds_mla", "xl:deepseek.fp8_ds_mla"),
             ("xl:deepseek.fp8_ds_mla", "deepseek.fp8_ds_mla")]
TPS = [(p, d) for p in (1, 2, 4) for d in (1, 2, 4)]
BLOCKS = [(4, 8), (8, 4)]  # (prefill, decode) block sizes
CASES = [("gqa", pair, tp, bs) for pair in PAIRS for tp in TPS for bs in BLOCKS] + \
    [("replicated", pair, tp, bs) for pair in PAIRS[::2] for tp in TPS for bs in BLOCKS] + \
    [("mla", pair, tp, bs) for pair in MLA_PAIRS for tp in TPS for bs in BLOCKS]


def layout(name, spec, num_blocks, shard):
    if name.startswith("xl:"):
        lay = cross_layer_twin(Layout.preset(name[3:], spec, num_blocks, LAYERS),
                               num_blocks, LAYERS)
    else:
        lay = Layout.preset(name, spec, num_blocks, LAYERS)
    return attrs.evolve(lay, shard=shard)


def rank_layouts(name, kind, tp, block_size, num_blocks, dtype="float16"):
    out = []
    heads = 1 if kind == "mla" else KINDS[kind]
    for r in range(tp):
        shard = Shard.tp(r, tp, heads)
        if kind == "mla":
            spec = KVSpec("mla", block_size=block_size, num_kv_heads=1, head_dim=576,
                          head_dim_v=512, dtype="bfloat16")
        else:
            spec = KVSpec("full", block_size=block_size, num_kv_heads=len(shard.heads),
                          head_dim=DIM, dtype=dtype)
        out.append(layout(name, spec, num_blocks, shard))
    return out


def run_case(kind, pair, tp, bs, *, tokens, whole_blocks, seed=0, layers=None):
    rng = np.random.default_rng(seed)
    srcs = rank_layouts(pair[0], kind, tp[0], bs[0], 7)
    dsts = rank_layouts(pair[1], kind, tp[1], bs[1], 6)
    heads = 1 if kind == "mla" else KINDS[kind]
    model = component_model(rng, srcs[0], LAYERS, tokens, heads)
    lay = list(range(LAYERS)) if layers is None else layers
    s_slots, s_blocks = table(rng, tokens, bs[0], 7)
    d_slots, d_blocks = table(rng, tokens, bs[1], 6)
    caches = []
    for s in srcs:
        bufs, cache = component_cache(s, rng)  # noise everywhere, then the model's KV
        write_components(bufs, s, model, range(LAYERS), s_slots)
        caches.append(cache)
    if whole_blocks:
        plans = plan_tp_transfer(srcs, dsts, s_blocks, d_blocks, layers=layers)
    else:
        plans = [plan_shard_transfer(srcs, d, s_slots, d_slots, layers=layers) for d in dsts]
    for d, plan in zip(dsts, plans):
        bufs, cache = component_cache(d)
        before = [b.copy() for b in bufs]
        assert execute_shards(plan, caches, cache) is cache
        check_components(bufs, before, d, model, lay, d_slots, srcs)
    return plans


@pytest.mark.parametrize("kind,pair,tp,bs", CASES,
                         ids=[f"{k}-{a}>{b}-tp{p}>{d}-bs{x}>{y}" for k, (a, b), (p, d), (x, y)
                              in CASES])
def test_matrix(kind, pair, tp, bs):
    plans = run_case(kind, pair, tp, bs, tokens=13, whole_blocks=False)
    for plan in plans:  # each destination reads each of its heads once
        assert sum(r.count for r in plan.runs) == plan.dst_layout.size("H")
    # whole blocks: both token sequences cover the same 16 positions
    run_case(kind, pair, tp, bs, tokens=16, whole_blocks=True, seed=1)


def test_some_layers_only():
    run_case("gqa", ("vllm.int8_per_token_head", "vllm.int8_per_token_head"), (1, 2),
             (4, 8), tokens=9, whole_blocks=False, layers=[1])


def test_scales_travel_with_their_heads():
    # int8 per (token, head), TP 1 -> 2: rank 1's scale bytes are the source's scales of
    # heads 2 and 3 (the plan reads them from their own H stride, not the data's)
    srcs = rank_layouts("vllm.int8_per_token_head", "gqa", 1, 4, 3)
    dst = rank_layouts("vllm.int8_per_token_head", "gqa", 2, 4, 3)[1]
    plan = plan_shard_block_transfer(srcs, dst, [1], [2])
    r = plan.parts[0][1].regions
    src, ks = srcs[0], srcs[0].component("key_scale")
    want = [src.element_offset("key_scale", layer=lay, block=1, token=n, head=h)[1]
            for lay in range(LAYERS) for n in range(4) for h in (2, 3)]
    read = {int(o) for s0, n in zip(r[:, 1], r[:, 4]) for o in range(s0, s0 + n)}
    assert {o + i for o in want for i in range(ks.unit)} <= read
    first = [src.element_offset("key_scale", layer=0, block=1, token=0, head=h)[1]
             for h in (0, 1)]
    assert not read & {o + i for o in first for i in range(ks.unit)}  # heads 0, 1 stay


# -- components shared by a rank's heads -------------------------------------------------
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (1, 2), (1, 4), (2, 4), (4, 4), (2, 8)])
def test_shared_record_is_copied_from_the_one_source(p_tp, d_tp):
    # splitting heads: each destination rank's one record is the source rank's record
    # (the scale of all that rank's heads); one head per rank is per head
    rng = np.random.default_rng(p_tp * 10 + d_tp)
    heads = 4
    srcs = shared_scale_group(p_tp, heads)
    dsts = [shared_scale_layout(len(Shard.tp(r, d_tp, heads).heads), Shard.tp(r, d_tp, heads))
            for r in range(d_tp)]
    model = component_model(rng, srcs[0], LAYERS, 8, heads)
    caches = []
    for s in srcs:
        bufs, cache = component_cache(s, rng)
        write_components(bufs, s, model, range(LAYERS), np.arange(8))
        caches.append(cache)
    for d in dsts:
        plan = plan_shard_transfer(srcs, d, np.arange(8), np.arange(8, 16))
        bufs, cache = component_cache(d)
        before = [b.copy() for b in bufs]
        execute_shards(plan, caches, cache)
        check_components(bufs, before, d, model, range(LAYERS), np.arange(8, 16), srcs)


def test_shared_record_from_several_sources_is_refused():
    # TP 2 -> 1: the destination's one scale per token would be two ranks' scales
    with pytest.raises(KVABIError, match=r"dst_layout\.components\.key_scale: one record "
                                         r"for all 4 heads .* source ranks \[0, 1\]"):
        plan_shard_transfer(shared_scale_group(2), shared_scale_group(1)[0], [0], [0])
    # per (token, head) scales cannot become one scale shared by heads (nor the reverse)
    per_head = rank_layouts("vllm.int8_per_token_head", "gqa", 1, 4, 4)
    with pytest.raises(KVABIError, match=r"dst_layout\.components\.key_scale: per token "
                                         r"on the destination's heads 0\.\.1, per \(token, "
                                         r"head\)"):
        plan_shard_transfer(per_head, shared_scale_group(2)[0], [0], [0])
    with pytest.raises(KVABIError, match=r"dst_layout\.components\.key_scale: per \(token, "
                                         r"head\) on the destination's heads 0\.\.1, per "
                                         r"token"):
        plan_shard_transfer(shared_scale_group(1),
                            rank_layouts("vllm.int8_per_token_head", "gqa", 2, 4, 4)[0],
                            [0], [0])


# -- refusals by field, before any plan ------------------------------------------------------
@pytest.mark.parametrize("src,dst,match", [
    (("vllm.int8_per_token_head", 2), ("vllm.fp8_per_token_head", 1), "dst_layout.dtype: "
     "float8_e4m3fn differs"),
    # fp8 codes with scales against fp8 codes without: the scales are not optional
    (("vllm.fp8_per_token_head", 2), ("flashinfer.HND", 1),
     r"dst_layout\.components\.key_scale: the source holds key_scale"),
    (("vllm.cpu", 2), ("vllm.fp8_per_token_head", 1), "dst_layout.dtype"),
    (("deepseek.fp8_ds_mla", 2), ("vllm.cpu", 1), r"dst_layout\.shard\.of"),
])
def test_other_quantization_refused_by_field(src, dst, match):
    kind = "mla" if src[0].startswith("deepseek") else "gqa"
    srcs = rank_layouts(src[0], kind, src[1], 4, 4)
    d = rank_layouts(dst[0], "gqa", dst[1], 4, 4, dtype="float8_e4m3fn" if
                     dst[0] == "flashinfer.HND" else "float16")[0]
    with pytest.raises(KVABIError, match=match):
        plan_shard_transfer(srcs, d, [0, 1], [0, 1])


def test_scale_count_refused_by_field():
    # two key scales per (token, head) (one per 4 elements) against vLLM's one
    rec = 28  # K 8 | two key scales 8 | V 8 | value scale 4
    outer = {"L": 4 * 2 * 4 * rec, "B": 2 * 4 * rec, "H": 4 * rec, "N": rec}
    comps = [Component(name="key", dtype="int8", count=DIM, strides={**outer, "E": 1}),
             Component(name="key_scale", dtype="float32", count=2, offset=8,
                       strides={**outer, "E": 4}),
             Component(name="value", dtype="int8", count=DIM, offset=16,
                       strides={**outer, "E": 1}),
             Component(name="value_scale", dtype="float32", count=1, offset=24,
                       strides=outer)]
    srcs = [Layout(sizes={"L": LAYERS, "B": 4, "N": 4, "H": 2}, components=comps,
                   shard=Shard.tp(r, 2, 4)) for r in range(2)]
    dst = rank_layouts("vllm.int8_per_token_head", "gqa", 1, 4, 4)[0]
    with pytest.raises(KVABIError, match=r"dst_layout\.components\.key_scale\.count: 1, "
                                         r"the source's is 2"):
        plan_shard_transfer(srcs, dst, [0], [0])


# -- random shardings of component layouts (the thorough profile runs more) ------------------
GROUPS = [["vllm.cpu", "vllm.cpu.BLHNC", "flashinfer.HND", "vllm.BHLNC", "xl:vllm.cpu"],
          ["vllm.fp8_per_token_head", "flashinfer.HND.fp8_inline_scale",
           "flashinfer.HND.fp8_scale_plane", "xl:flashinfer.HND.fp8_scale_plane"],
          ["vllm.int4_per_token_head", "xl:vllm.int4_per_token_head"]]


@st.composite
def shardings(draw):
    group = draw(st.sampled_from(GROUPS))
    pair = (draw(st.sampled_from(group)), draw(st.sampled_from(group)))
    kind = draw(st.sampled_from(["gqa", "replicated"]))
    tp = (draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4])))
    bs = (draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8])))
    return kind, pair, tp, bs


@settings(max_examples=max(10, settings().max_examples // 4), deadline=None)
@given(shardings(), st.integers(1, 20), st.integers(0, 2**31))
def test_random_shardings(case, tokens, seed):
    kind, pair, tp, bs = case
    tokens = min(tokens, 7 * bs[0], 6 * bs[1])
    run_case(kind, pair, tp, bs, tokens=tokens, whole_blocks=False, seed=seed)


# -- checksums over every component (scales included) ---------------------------------------
@pytest.mark.parametrize("kind,pair", [
    ("gqa", ("vllm.cpu", "flashinfer.HND")),             # keys placed apart: same sums
    ("gqa", ("vllm.int8_per_token_head", "xl:vllm.int8_per_token_head")),
    ("gqa", ("flashinfer.HND.fp8_scale_plane", "vllm.fp8_per_token_head")),
    ("gqa", ("vllm.int4_per_token_head", "xl:vllm.int4_per_token_head")),  # packed codes
    ("mla", ("deepseek.fp8_ds_mla", "xl:deepseek.fp8_ds_mla")),
])
def test_checksums_over_components_agree_and_see_one_scale_byte(kind, pair):
    from kvabi.transfer.checksum import check_checksums, kv_checksums
    from shard_oracle import GUARD

    rng = np.random.default_rng(5)
    heads = 1 if kind == "mla" else KINDS[kind]
    tp = (2, 1) if kind == "gqa" else (2, 2)
    srcs = rank_layouts(pair[0], kind, tp[0], 4, 7)
    dst = rank_layouts(pair[1], kind, tp[1], 8, 6)[0]
    model = component_model(rng, srcs[0], LAYERS, 13, heads)
    s_slots, d_slots = table(rng, 13, 4, 7)[0], table(rng, 13, 8, 6)[0]
    sums = []
    for s in srcs:
        bufs, cache = component_cache(s, rng)
        write_components(bufs, s, model, range(LAYERS), s_slots)
        sums.append(kv_checksums(cache, s_slots, chunk=4))
    bufs, cache = component_cache(dst, rng)
    write_components(bufs, dst, model, range(LAYERS), d_slots, srcs)
    got = kv_checksums(cache, d_slots, chunk=4)
    for r, s in enumerate(sums):  # each rank's heads: the same sums through either layout
        check_checksums(got, s, s.heads, f"rank {r}")
    # one byte of the last component (a scale where there is one), token 9, layer 1
    c = dst.components[-1]
    h = dst.size("H") - 1 if c.varies("H") else 0
    p, o = dst.element_offset(c.name, layer=1, block=d_slots[9] // 8, token=d_slots[9] % 8,
                              head=h)
    bufs[p][o + GUARD] ^= 1
    g = dst.shard.heads[h]
    rank = next(r for r, s in enumerate(srcs) if g in s.shard.heads)
    bad = kv_checksums(cache, d_slots, chunk=4)
    with pytest.raises(KVABIError, match=rf"checksum: global head {g}, tokens 8..11 differ "
                                         rf"from rank's \(1 of 4 chunks\)"):
        check_checksums(bad, sums[rank], (g,), "rank")
