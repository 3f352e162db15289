"""negotiate(): same bytes / a relayout and its cost / a refusal naming every field; the
cost against the full plan it prices; a remote group that lies is refused."""
from __future__ import annotations

import math

import attrs
import numpy as np
import pytest

from kvabi import KVABIError, KVSpec, Layout
from kvabi.model.shard import Shard
from kvabi.transfer import Refused, negotiate, plan_shard_block_transfer
from kvabi.transfer.handshake import make_handshake, parse_handshake

SPEC = KVSpec("full", block_size=16, num_kv_heads=4, head_dim=8, dtype="bfloat16")


def lay(name, spec=SPEC, blocks=10, layers=3, shard=None, **over):
    out = Layout.preset(name, attrs.evolve(spec, **over), blocks, layers)
    return attrs.evolve(out, shard=shard) if shard is not None else out


def ranks(name, tp, heads=4, **over):
    return [lay(name, num_kv_heads=len(Shard.tp(r, tp, heads).heads),
                shard=Shard.tp(r, tp, heads), **over) for r in range(tp)]


@pytest.mark.parametrize("a,b", [
    (lay("vllm.LBHNC"), lay("vllm.LBHNC", blocks=7)),       # other pool size
    (lay("flashinfer.HND", page_align=4096), lay("flashinfer.HND", blocks=3, page_align=4096)),
    (lay("tpu.hidden"), lay("flash_attn", blocks=5)),       # another name, the same bytes
    (lay("vllm.cpu"), lay("vllm.cpu", blocks=4)),           # components: keys apart
    (lay("flashinfer.HND").component_form(), lay("flashinfer.HND", blocks=3)),
    (lay("vllm.int8_per_token_head"), lay("vllm.int8_per_token_head", blocks=6)),
])
def test_same_bytes(a, b):
    n = negotiate(a, b)
    assert n.kind == "same" and n.differences == () and n.sources == (0,)
    assert n.cost().staging_bytes == 0 and not n.staged
    # a direct plan: each block of each plane chunk is one region on both sides
    plan = plan_shard_block_transfer([b], a, [1, 2], [0, 2])
    assert len(plan) == 2 * n.cost().regions


@pytest.mark.parametrize("a,b,why", [
    (lay("flashinfer.HND"), lay("flashinfer.NHD"), ("order",)),
    (lay("vllm.LBHNC"), lay("vllm.LBHNC", block_size=32), ("sizes.N",)),
    (attrs.evolve(lay("flashinfer.HND"), extents={"D": 16}), lay("flashinfer.HND"),
     ("strides",)),  # heads padded inside the block
    (lay("flashinfer.HND"), ranks("flashinfer.HND", 2), ("shard",)),
    (lay("flashinfer.HND", num_kv_heads=2, shard=Shard.tp(1, 2, 4)), lay("flashinfer.HND"),
     ("shard",)),
    # vLLM's CPU cache (keys [D, N], values [N, D] per block and head) and FlashInfer
    (lay("vllm.cpu"), ranks("flashinfer.HND", 2), ("shard", "order")),
    (lay("vllm.cpu"), lay("vllm.cpu.LHBNC"), ("order",)),
    (lay("vllm.fp8_per_token_head"), lay("flashinfer.HND.fp8_inline_scale"), ("order",)),
    (lay("flashinfer.HND.fp8_inline_scale"), ranks("flashinfer.HND.fp8_scale_plane", 4),
     ("shard", "order")),
    (lay("vllm.int8_per_token_head", block_size=8), lay("vllm.int8_per_token_head"),
     ("sizes.N",)),
])
def test_relayout_says_why(a, b, why):
    n = negotiate(a, b)
    assert n.kind == "relayout" and n.differences == why


@pytest.mark.parametrize("dst,srcs", [
    (lay("flashinfer.HND", block_size=32), [lay("vllm.LBHNC")]),
    (lay("vllm.BLHNC", block_size=8), [lay("kvbm.fully_contiguous")]),  # cross-layer
    (lay("flashinfer.NHD", block_size=32), ranks("flashinfer.HND", 2)),
    (lay("vllm.BHLNC", num_kv_heads=2, shard=Shard.tp(1, 2, 4)), ranks("vllm.LBNHC", 4)),
    (lay("tpu.combined", num_kv_heads=1, shard=Shard.tp(5, 8, 4), block_size=8),
     ranks("flashinfer.HND", 1)),
    (lay("vllm.cpu"), ranks("flashinfer.HND", 2)),
    (lay("flashinfer.HND", block_size=8), ranks("vllm.cpu", 4)),
    (lay("vllm.int8_per_token_head", num_kv_heads=2, shard=Shard.tp(1, 2, 4), block_size=32),
     ranks("vllm.int8_per_token_head", 1)),
    (lay("flashinfer.HND.fp8_scale_plane", block_size=8),
     ranks("flashinfer.HND.fp8_inline_scale", 2)),
    (lay("vllm.cpu"), [lay("vllm.cpu", blocks=4)]),  # same bytes: regions, no staging
])
def test_cost_is_the_full_plans(dst, srcs):
    """Priced on one and two layers; the plan of every layer over lcm(block sizes) tokens
    gives the same regions and bytes per destination block."""
    c = negotiate(dst, srcs).cost()
    bs_s, bs_d = srcs[0].size("N"), dst.size("N")
    tokens = math.lcm(bs_s, bs_d)
    plan = plan_shard_block_transfer(srcs, dst, np.arange(tokens // bs_s),
                                     np.arange(tokens // bs_d))
    per = tokens // bs_d
    same = negotiate(dst, srcs).kind == "same"
    assert c.regions == -(-len(plan) // per)
    assert c.staging_bytes == (0 if same else plan.nbytes // per)


def _handshake(layout, model=None, abi=None):
    text = make_handshake(agent_name="peer", host="127.0.0.1", port=5600, memory="DRAM",
                          layout=layout, planes=[(1 << 30, layout.plane_nbytes, 0)] *
                          layout.num_planes, model=model)
    h = parse_handshake(text)
    return h if abi is None else attrs.evolve(h, abi=abi)


def test_refusal_names_every_field_at_once():
    mine = _handshake(lay("flashinfer.HND"), model="llama@1")
    theirs = _handshake(lay("flashinfer.HND", dtype="float16", head_dim=16, head_dim_v=16,
                            layers=4),
                        model="mistral@7", abi=(9, 0))
    with pytest.raises(Refused) as e:
        negotiate(mine, theirs)
    assert e.value.fields == ("kvabi_abi", "model", "dtype", "sizes.D", "sizes.L")
    assert isinstance(e.value, KVABIError)
    assert "the peer serves model 'mistral@7', this cache 'llama@1'" in str(e.value)


@pytest.mark.parametrize("remote,field", [
    (lay("vllm.LBHNC", kind="mla", num_kv_heads=1), "sizes.KV"),
    (ranks("flashinfer.HND", 2, heads=8), "shard.of"),
    (lay("flashinfer.HND", dtype="int8"), "dtype"),
])
def test_data_refusals(remote, field):
    with pytest.raises(Refused) as e:
        negotiate(lay("flashinfer.HND"), remote)
    assert field in e.value.fields


def _scales(name="vllm.int8_per_token_head", scale_dtype=None, scale_count=None):
    """A per-token-head int8 layout whose key scale has another dtype or count (the
    record: K 8 | key scales 8 | V 8 | value scale 4)."""
    from kvabi import Component

    base = lay(name)
    if scale_count is None:  # same slot, another dtype
        comps = [attrs.evolve(c, dtype=scale_dtype) if c.name == "key_scale" else c
                 for c in base.components]
        return Layout(sizes=base.sizes, components=comps)
    rec = 28
    outer = {"L": 10 * 4 * 16 * rec, "B": 4 * 16 * rec, "H": 16 * rec, "N": rec}
    comps = [Component(name="key", dtype="int8", count=8, strides={**outer, "E": 1}),
             Component(name="key_scale", dtype="float32", count=scale_count, offset=8,
                       strides={**outer, "E": 4}),
             Component(name="value", dtype="int8", count=8, offset=16,
                       strides={**outer, "E": 1}),
             Component(name="value_scale", dtype="float32", count=1, offset=24,
                       strides=outer)]
    return Layout(sizes=base.sizes, components=comps)


@pytest.mark.parametrize("mine,remote,fields", [
    # int8 codes against fp8 codes (both with float32 scales per (token, head))
    (lay("vllm.int8_per_token_head"), lay("vllm.fp8_per_token_head"), ("dtype",)),
    # fp8 codes with scales against fp8 codes without: the scales are not optional
    (lay("vllm.fp8_per_token_head"), lay("flashinfer.HND", dtype="float8_e4m3fn"),
     ("components.key_scale", "components.value_scale")),
    (lay("flashinfer.HND"), lay("vllm.int8_per_token_head"),
     ("dtype", "components.key_scale", "components.value_scale")),
    # the scale's dtype, and two scales per (token, head) against one
    (lay("vllm.int8_per_token_head"), _scales(scale_dtype="float16"),
     ("components.key_scale.dtype",)),
    (lay("vllm.int8_per_token_head"), _scales(scale_count=2), ("components.key_scale.count",)),
])
def test_quantization_refused_by_component_field(mine, remote, fields):
    with pytest.raises(Refused) as e:
        negotiate(mine, remote)
    assert e.value.fields == fields
    assert isinstance(e.value, KVABIError)


def test_scale_granularity_along_heads_refused_per_run():
    # one key scale per token shared by a rank's two heads against per (token, head)
    from shard_oracle import shared_scale_group

    shared = shared_scale_group(2)
    per_head = [attrs.evolve(Layout.preset("vllm.int8_per_token_head", attrs.evolve(
        SPEC, block_size=4, num_kv_heads=2), 4, 2), shard=Shard.tp(r, 2, 4)) for r in range(2)]
    with pytest.raises(Refused, match=r"components.key_scale: per \(token, head\) on the "
                                      r"destination's heads 0..1, per token") as e:
        negotiate(per_head[0], shared)
    assert e.value.fields == ("components.key_scale", "components.value_scale")
    # a rank of TP 1 would assemble its shared scale from two ranks' scales
    one = shared_scale_group(1)[0]
    with pytest.raises(Refused, match="one record for all 4 heads") as e:
        negotiate(one, shared)
    assert e.value.fields == ("components.key_scale", "components.value_scale")
    assert negotiate(shared[1], one).kind == "relayout"  # a subset of one rank's heads


@pytest.mark.parametrize("make,match", [
    (lambda g: g[::-1], r"src_layouts\[0\].shard.rank: says rank 1"),
    (lambda g: [g[0], attrs.evolve(g[1], shard=attrs.evolve(g[1].shard, heads=(0, 1)))],
     r"src_layouts\[1\].shard.heads"),
    (lambda g: g[:1], r"src_layouts\[0\].shard.ranks"),
])
def test_a_lying_group_is_refused(make, match):
    with pytest.raises(KVABIError, match=match):
        negotiate(lay("flashinfer.HND"), make(ranks("flashinfer.NHD", 2)))


def test_bad_arguments():
    with pytest.raises(KVABIError, match="local: must be a kvabi.Layout or a Handshake"):
        negotiate("flashinfer.HND", lay("flashinfer.HND"))
    with pytest.raises(KVABIError, match="remote: must be"):
        negotiate(lay("flashinfer.HND"), [])
    with pytest.raises(KVABIError, match=r"remote\[1\]: must be"):
        negotiate(lay("flashinfer.HND"), [lay("flashinfer.HND"), "x"])


def test_a_local_component_layout_negotiates():
    # a vLLM CPU rank (keys and values placed apart) with a FlashInfer group of one model
    n = negotiate(lay("vllm.cpu", num_kv_heads=2, shard=Shard.tp(0, 2, 4)),
                  ranks("flashinfer.HND", 1))
    assert n.kind == "relayout" and n.differences == ("shard", "order")
    assert n.cost().regions > 0 and n.cost().staging_bytes > 0
