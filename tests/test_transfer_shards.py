"""Plans between shardings, executed locally: prefill TP x decode TP in {1, 2, 4}^2 x
{GQA, fewer KV heads than ranks (replicated), MLA} x layout pairs (NHD <-> HND, cross-layer,
TPU combined heads) x block sizes larger and smaller on either side.  Every destination
byte equals the model's KV of its global head (``shard_oracle``: written from the shard
definition, never through a plan), guard and untouched bytes keep their poison; and what
the heads do not allow is refused by field before any plan exists."""
from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvabi import KVABIError, KVSpec, Layout
from kvabi.layout.presets import preset_names
from kvabi.model.shard import Shard
from kvabi.transfer.shards import (assign, execute_shards, plan_shard_block_transfer,
                                   plan_shard_transfer, plan_tp_transfer)
from shard_oracle import check_rank, guarded_cache, model_kv, table, write_rank

LAYERS = 2
KINDS = {  # name: (kind, global KV heads)
    "gqa": ("full", 4),
    "replicated": ("full", 2),  # TP 4 holds each head on two ranks
    "mla": ("mla", 1),
}
PAIRS = {
    "full": [("flashinfer.NHD", "flashinfer.HND"), ("flashinfer.HND", "flashinfer.NHD"),
             ("vllm.LBHNC", "kvbm.fully_contiguous"), ("vllm.BHLNC", "tpu.combined")],
    "mla": [("vllm.LBNHC", "vllm.BLHNC"), ("kvbm.fully_contiguous", "vllm.LHBNC"),
            ("vllm.cpu_kt", "kvbm.layer_separate")],
}
TPS = [(p, d) for p in (1, 2, 4) for d in (1, 2, 4)]
BLOCKS = [(4, 8), (8, 4)]  # (prefill, decode) block sizes: decode's larger, then smaller
CASES = [(k, pair, tp, bs) for k in KINDS for pair in PAIRS[KINDS[k][0]] for tp in TPS
         for bs in BLOCKS]


def rank_layouts(preset, kind, heads, tp, block_size, num_blocks, dim=8, dtype="float16"):
    out = []
    for r in range(tp):
        shard = Shard.tp(r, tp, heads)
        spec = KVSpec(kind, block_size=block_size, num_kv_heads=len(shard.heads),
                      head_dim=dim, dtype=dtype)
        out.append(attrs.evolve(Layout.preset(preset, spec, num_blocks, LAYERS), shard=shard))
    return out


def run_case(kind, heads, pair, tp, bs, *, tokens, whole_blocks, seed=0, layers=None):
    rng = np.random.default_rng(seed)
    (p_preset, d_preset), (p_tp, d_tp), (p_bs, d_bs) = pair, tp, bs
    srcs = rank_layouts(p_preset, kind, heads, p_tp, p_bs, 7)
    dsts = rank_layouts(d_preset, kind, heads, d_tp, d_bs, 6)
    isz = srcs[0].itemsize
    content = model_kv(rng, LAYERS, tokens, kind != "mla", heads, 8, isz)
    lay = list(range(LAYERS)) if layers is None else layers
    s_slots, s_blocks = table(rng, tokens, p_bs, 7)
    d_slots, d_blocks = table(rng, tokens, d_bs, 6)
    src_caches = []
    for lay_r in srcs:
        bufs, cache = guarded_cache(lay_r, rng)  # noise everywhere, then the model's KV
        write_rank(bufs, lay_r, content, range(LAYERS), s_slots)
        src_caches.append(cache)
    if whole_blocks:
        plans = plan_tp_transfer(srcs, dsts, s_blocks, d_blocks, layers=layers)
    else:
        plans = [plan_shard_transfer(srcs, d, s_slots, d_slots, layers=layers) for d in dsts]
    for d_lay, plan in zip(dsts, plans):
        bufs, cache = guarded_cache(d_lay)
        before = [b.copy() for b in bufs]
        assert execute_shards(plan, src_caches, cache) is cache
        check_rank(bufs, before, d_lay, content, lay, d_slots)
    return plans


@pytest.mark.parametrize("kind_name,pair,tp,bs", CASES,
                         ids=[f"{k}-{a}>{b}-tp{p}>{d}-bs{x}>{y}" for k, (a, b), (p, d), (x, y)
                              in CASES])
def test_matrix(kind_name, pair, tp, bs):
    kind, heads = KINDS[kind_name]
    plans = run_case(kind, heads, pair, tp, bs, tokens=13, whole_blocks=False)
    for plan in plans:  # each destination reads its heads once, from the ranks holding them
        assert sum(r.count for r in plan.runs) == plan.dst_layout.size("H")
    if kind == "mla" or tp[0] <= heads and tp[1] <= heads and tp[0] <= tp[1]:
        assert all(len(p.sources) == 1 for p in plans)  # one source holds all its heads
    # whole blocks: the token sequences of both sides cover the same 16 positions
    run_case(kind, heads, pair, tp, bs, tokens=16, whole_blocks=True, seed=1)


def test_reads_spread_across_replicas():
    # MLA: every prefill rank holds the latent; decode ranks read from different ones
    srcs = rank_layouts("vllm.LBHNC", "mla", 1, 2, 4, 4)
    dsts = rank_layouts("vllm.BLHNC", "mla", 1, 4, 4, 4)
    plans = plan_tp_transfer(srcs, dsts, [0, 1], [2, 3])
    assert [p.sources for p in plans] == [(0,), (1,), (0,), (1,)]
    # two heads on four prefill ranks (two replicas each) -> decode TP 1 reads one of each
    runs = assign([Shard.tp(r, 4, 2) for r in range(4)], Shard.tp(0, 1, 2))
    assert [(r.source, r.src_first, r.dst_first, r.count) for r in runs] == [(0, 0, 0, 1),
                                                                            (2, 0, 1, 1)]


def test_some_layers_only():
    run_case("full", 4, ("flashinfer.NHD", "vllm.BLHNC"), (2, 4), (4, 8), tokens=9,
             whole_blocks=False, layers=[1])


# -- refusals, before any plan ---------------------------------------------------------------
def _srcs(tp=2, heads=4, **kw):
    return rank_layouts("flashinfer.HND", "full", heads, tp, 4, 6, **kw)


DST = rank_layouts("flashinfer.NHD", "full", 4, 1, 8, 4)[0]


@pytest.mark.parametrize("make_srcs,dst,match", [
    (lambda: _srcs()[::-1], DST, r"src_layouts\[0\].shard.rank: says rank 1 at position 0"),
    (lambda: [attrs.evolve(s, shard=attrs.evolve(s.shard, heads=(0, 1))) for s in _srcs()],
     DST, r"src_layouts\[1\].shard.heads: rank 1 of 2 holds \[2, 3\]"),
    (lambda: _srcs()[:1], DST, r"src_layouts\[0\].shard.ranks"),
    (lambda: _srcs(), rank_layouts("flashinfer.NHD", "full", 8, 2, 8, 4)[0],
     "dst_layout.shard.of: 8 KV heads"),
    (lambda: _srcs(dtype="bfloat16"), DST, "dst_layout.dtype"),
    (lambda: _srcs(dim=16), DST, "dst_layout.sizes.D"),
    (lambda: rank_layouts("vllm.LBHNC", "mla", 1, 2, 4, 6), DST, "dst_layout.shard.of"),
    (lambda: [_srcs()[0], rank_layouts("flashinfer.HND", "full", 4, 2, 8, 6)[1]], DST,
     r"src_layouts\[1\].sizes.N"),
    (lambda: _srcs()[0], DST, "src_layouts: must be a list"),
    (lambda: [], DST, "src_layouts: no source ranks"),
    (lambda: ["flashinfer.HND"], DST, r"src_layouts\[0\]: must be a kvabi.Layout"),
    # component layouts: see test_transfer_shards_components.py
])
def test_refused_by_field(make_srcs, dst, match):
    with pytest.raises(KVABIError, match=match):
        plan_shard_transfer(make_srcs(), dst, [0, 1], [0, 1])


def test_nonstandard_shards_when_asked():
    # an engine that interleaves heads: refused as a lie by default, planned when allowed
    spec = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")
    srcs = [attrs.evolve(Layout.preset("flashinfer.HND", spec, 4, LAYERS),
                         shard=Shard(heads=(r, r + 2), of=4, rank=r, ranks=2))
            for r in range(2)]
    with pytest.raises(KVABIError, match="shard.heads"):
        plan_shard_transfer(srcs, DST, [0], [0])
    plan = plan_shard_transfer(srcs, DST, [0], [0], standard=False)
    assert [(r.source, r.src_first, r.dst_first) for r in plan.runs] == [
        (0, 0, 0), (1, 0, 1), (0, 1, 2), (1, 1, 3)]
    missing = [srcs[0], attrs.evolve(srcs[1], shard=Shard((1, 0), of=4, rank=1, ranks=2))]
    with pytest.raises(KVABIError, match="global head 3 of 4 is held by no rank"):
        plan_shard_transfer(missing, DST, [0], [0], standard=False)


def test_execute_refuses_wrong_sources():
    srcs = _srcs()
    plan = plan_shard_transfer(srcs, DST, [0], [0])
    caches = [guarded_cache(s)[1] for s in srcs]
    with pytest.raises(KVABIError, match="srcs: one cache per source rank"):
        execute_shards(plan, caches[:1], guarded_cache(DST)[1])
    with pytest.raises(KVABIError, match="plan: must be a ShardPlan"):
        execute_shards(plan.parts[0][1], caches, guarded_cache(DST)[1])


# -- random shardings (the thorough profile runs many) -----------------------------------------
@st.composite
def shardings(draw):
    kind = draw(st.sampled_from(["full", "mla"]))
    heads = 1 if kind == "mla" else draw(st.sampled_from([1, 2, 4, 8]))
    spec = KVSpec(kind, block_size=4, num_kv_heads=1, head_dim=8, dtype="float16")
    names = [n for n in preset_names(spec) if n != "tpu.combined"]
    pair = (draw(st.sampled_from(names)), draw(st.sampled_from(names)))
    tp = (draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8])))
    bs = (draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8])))
    return kind, heads, pair, tp, bs


@settings(max_examples=2 * settings().max_examples, deadline=None)  # thorough: 800
@given(shardings(), st.integers(1, 20), st.integers(0, 2**31))
def test_random_shardings(case, tokens, seed):
    kind, heads, pair, tp, bs = case
    if -(-tokens // bs[0]) > 7 or -(-tokens // bs[1]) > 6:
        tokens = min(7 * bs[0], 6 * bs[1])
    run_case(kind, heads, pair, tp, bs, tokens=tokens, whole_blocks=False, seed=seed)


# -- checksums: computed on each side through its own layout -----------------------------------
def test_checksums_agree_across_layouts_and_shards_and_see_one_byte():
    from kvabi.transfer.checksum import KVChecksums, check_checksums, kv_checksums

    rng = np.random.default_rng(3)
    content = model_kv(rng, LAYERS, 13, True, 4, 8, 2)
    src = rank_layouts("flashinfer.NHD", "full", 4, 2, 4, 7)
    dst = rank_layouts("tpu.combined", "full", 4, 1, 8, 6)[0]
    s_slots, d_slots = table(rng, 13, 4, 7)[0], table(rng, 13, 8, 6)[0]
    sums = []
    for lay in src:
        bufs, cache = guarded_cache(lay, rng)
        write_rank(bufs, lay, content, range(LAYERS), s_slots)
        sums.append(kv_checksums(cache, s_slots, chunk=4))
    bufs, cache = guarded_cache(dst, rng)
    write_rank(bufs, dst, content, range(LAYERS), d_slots)
    got = kv_checksums(cache, d_slots, chunk=4)
    assert got.values.shape == (4, 4) and got.heads == (0, 1, 2, 3)
    for r, s in enumerate(sums):
        back = KVChecksums.from_json(s.to_json())
        assert back.heads == s.heads and np.array_equal(back.values, s.values)
        check_checksums(got, back, s.heads, f"rank {r}")
    # one byte of head 3, token 9, layer 1, value: only that chunk of that head differs
    from transfer_oracle import element_bytes
    plane, off = element_bytes(dst, [1], [d_slots[9]])
    bufs[int(plane[0, 0, 1, 3, 2])][int(off[0, 0, 1, 3, 2]) + 64] ^= 1
    bad = kv_checksums(cache, d_slots, chunk=4)
    check_checksums(bad, sums[0], (0, 1), "rank 0")
    with pytest.raises(KVABIError, match=r"checksum: global head 3, tokens 8..11 differ from "
                                         r"rank 1's \(1 of 4 chunks\)"):
        check_checksums(bad, sums[1], (2, 3), "rank 1")
    with pytest.raises(KVABIError, match="checksums.chunk"):
        check_checksums(kv_checksums(cache, d_slots, chunk=8), sums[1], (2, 3), "rank 1")
    with pytest.raises(KVABIError, match="checksums.values"):
        KVChecksums.from_json(sums[0].to_json().replace('"chunk": 4', '"chunk": 2'))
