"""Shards: which global KV heads a layout holds (the tensor-parallel split against direct
formulas), their JSON and schema, untrusted input, group checks, and the model-wide view."""
import json
from pathlib import Path

import attrs
import jsonschema
import pytest

import kvabi
from kvabi import KVABIError, KVSpec, Layout
from kvabi.model.shard import Shard, check_group, shard_of
from kvabi.layout.tp_view import TPView

SCHEMA = json.loads((Path(__file__).parents[1] / "specs" / "layout.schema.json").read_text())
CONFIGS = Path(__file__).parents[1] / "examples" / "configs"
SPEC = KVSpec("full", block_size=4, num_kv_heads=4, head_dim=8, dtype="float16")


def _vllm_heads(rank, ranks, total):
    """vLLM's split, written out: max(1, total // ranks) heads per rank; with more ranks
    than heads, rank r holds head r // (ranks // total)."""
    per = max(1, total // ranks)
    if ranks <= total:
        return list(range(rank * per, rank * per + per))
    return [rank // (ranks // total)]


@pytest.mark.parametrize("total", [1, 2, 4, 8])
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_tp_split_is_the_engines(total, ranks):
    shards = [Shard.tp(r, ranks, total) for r in range(ranks)]
    for r, s in enumerate(shards):
        assert list(s.heads) == _vllm_heads(r, ranks, total)
        assert (s.rank, s.ranks, s.of) == (r, ranks, total)
        assert s.is_standard
    # every head held, each by max(1, ranks / heads) ranks
    count = {h: sum(h in s.heads for s in shards) for h in range(total)}
    assert set(count.values()) == {max(1, ranks // total)}
    assert check_group(shards) == tuple(shards)


def test_mla_is_replicated_on_every_rank():
    shards = [Shard.tp(r, 4, 1) for r in range(4)]
    assert all(s.heads == (0,) for s in shards)
    view = TPView(kvabi.ModelKV.from_hf_config(str(CONFIGS / "deepseek-v3.json")), 4)
    for r in range(4):
        lay = view.layouts(r, "vllm.LBHNC", 3)[0]
        assert not lay.has_kv and lay.shard.heads == (0,) and lay.shard.of == 1


@pytest.mark.parametrize("ranks,total", [(3, 4), (4, 6), (3, 2)])
def test_uneven_splits_refused(ranks, total):
    with pytest.raises(KVABIError, match="ranks"):
        Shard.tp(0, ranks, total)


@pytest.mark.parametrize("kwargs,field", [
    (dict(heads=[], of=4), "shard.heads"),
    (dict(heads=[0, 4], of=4), "shard.heads"),
    (dict(heads=[1, 1], of=4), "shard.heads"),
    (dict(heads=[-1], of=4), "shard.heads"),
    (dict(heads=[True], of=4), r"shard.heads\[0\]"),
    (dict(heads="01", of=4), "shard.heads"),
    (dict(heads=[0], of=0), "shard.of"),
    (dict(heads=[0], of=4, rank=2, ranks=2), "shard.rank"),
    (dict(heads=[0], of=4, rank=0, ranks=0), "shard.ranks"),
    (dict(heads=[0], of=4.0), "shard.of"),
])
def test_bad_shards_refused_by_field(kwargs, field):
    with pytest.raises(KVABIError, match=field):
        Shard(**kwargs)


def test_layout_states_its_shard_in_json():
    base = Layout.preset("flashinfer.HND", SPEC, 6, 2)
    lay = attrs.evolve(base, shard=Shard.tp(1, 2, 8))
    d = json.loads(lay.to_json())
    assert d["shard"] == {"heads": [4, 5, 6, 7], "of": 8, "rank": 1, "ranks": 2}
    jsonschema.validate(d, SCHEMA)
    back = Layout.from_json(lay.to_json())
    assert back == lay and back.shard == lay.shard and back != base
    assert shard_of(base) == Shard(heads=range(4), of=4)
    assert "shard" not in json.loads(base.to_json())  # a whole cache states nothing
    # a shard given as its JSON object is the same shard
    assert attrs.evolve(base, shard=d["shard"]).shard == lay.shard


@pytest.mark.parametrize("shard,field", [
    ({"heads": [0, 1], "of": 8, "rank": 0, "ranks": 4}, "shard.heads"),  # 2 heads, sizes.H 4
    ({"heads": [0, 1, 2, 3], "of": 8, "rank": 0}, "shard.ranks"),
    ({"heads": [0, 1, 2, 3], "of": 8, "rank": 0, "ranks": 2, "x": 1}, "shard.x"),
    ({"heads": [0, 1, 2, 3.0], "of": 8, "rank": 0, "ranks": 2}, r"shard.heads\[3\]"),
    ({"heads": {"0": 1}, "of": 8, "rank": 0, "ranks": 2}, "shard.heads"),
    ([0, 1, 2, 3], "shard"),
    ({"heads": [0, 1, 2, 3], "of": 8, "rank": 2, "ranks": 2}, "shard.rank"),
])
def test_untrusted_shards_refused_by_parser_and_schema(shard, field):
    d = json.loads(Layout.preset("flashinfer.HND", SPEC, 6, 2).to_json())
    d["shard"] = shard
    with pytest.raises(KVABIError, match=field):
        Layout.from_json(json.dumps(d))
    if field not in ("shard.heads", "shard.rank", r"shard.heads\[3\]"):  # what the
        # schema can express (not counts against sizes.H, ranks, nor 3.0 as no integer)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(d, SCHEMA)


def test_null_shard_is_every_head():
    d = json.loads(Layout.preset("flashinfer.HND", SPEC, 6, 2).to_json())
    d["shard"] = None
    jsonschema.validate(d, SCHEMA)
    assert Layout.from_json(json.dumps(d)).shard is None


def _group(ranks, total):
    return [Shard.tp(r, ranks, total) for r in range(ranks)]


@pytest.mark.parametrize("make,match", [
    (lambda g: [g[1], g[0]], r"sources\[0\].shard.rank: says rank 1 at position 0"),
    (lambda g: g[:1], r"sources\[0\].shard.ranks: says 2 ranks, the group has 1"),
    (lambda g: [g[0], attrs.evolve(g[1], heads=(0, 1, 2, 3))],
     r"sources\[1\].shard.heads: rank 1 of 2 holds \[4, 5, 6, 7\]"),
    (lambda g: [g[0], Shard((4, 5, 6, 7, 8), of=9, rank=1, ranks=2)], r"sources\[1\].shard.of"),
    (lambda g: [], "sources: no ranks"),
])
def test_group_checks(make, match):
    with pytest.raises(KVABIError, match=match):
        check_group(make(_group(2, 8)))


def test_nonstandard_group_needs_every_head():
    g = [Shard((0, 2), of=4, rank=0, ranks=2), Shard((1, 3), of=4, rank=1, ranks=2)]
    assert check_group(g, standard=False) == tuple(g)
    g[1] = Shard((1, 2), of=4, rank=1, ranks=2)
    with pytest.raises(KVABIError, match="global head 3 of 4 is held by no rank"):
        check_group(g, standard=False)


@pytest.mark.parametrize("config", ["llama-3-8b.json", "gemma-3-27b.json", "gpt-oss-20b.json"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_view_layouts_of_every_rank(config, tp):
    model = kvabi.ModelKV.from_hf_config(str(CONFIGS / config))
    view = TPView(model, tp)
    per_rank = view.all_layouts("vllm.BLHNC", 5)
    assert len(per_rank) == tp
    for gi, g in enumerate(model.groups):
        total = g.spec.num_kv_heads
        held = [lay for rank in per_rank for lay in [rank[gi]]]
        for r, lay in enumerate(held):
            assert list(lay.shard.heads) == _vllm_heads(r, tp, total)
            assert lay.size("H") == len(lay.shard.heads) == view.spec(r, gi).num_kv_heads
            assert lay.num_layers == len(g.layers) and lay.num_blocks == 5
        assert set().union(*(l.shard.heads for l in held)) == set(range(total))


def test_tp_view_refuses_unsplittable_groups():
    spec = KVSpec("full", block_size=4, num_kv_heads=6, head_dim=8)
    model = kvabi.ModelKV([kvabi.LayerKV("a", spec)])
    with pytest.raises(KVABIError, match=r"model.groups\[0\].spec.num_kv_heads"):
        TPView(model, 4)
    with pytest.raises(KVABIError, match="tp_size"):
        TPView(model, 0)
    with pytest.raises(KVABIError, match="model"):
        TPView("llama", 2)
    with pytest.raises(KVABIError, match="rank"):
        TPView(model, 2).shard(2)


def test_hostile_head_counts_cost_what_is_listed():
    """``of`` and ``ranks`` come from a peer: checks never count up to them."""
    import time

    big = 2**62
    t = time.perf_counter()
    liar = Shard(heads=(0,), of=big, rank=0, ranks=1)
    assert not liar.is_standard and not liar.is_whole
    with pytest.raises(KVABIError, match=r"holds \[0, 1, \.\.\., 4611686018427387903\] "
                                         r"\(4611686018427387904 heads\) of 4611686018427387904"):
        check_group([liar])
    with pytest.raises(KVABIError, match="global head 1 of 4611686018427387904 is held by "
                                         "no rank"):
        check_group([liar], standard=False)
    d = json.loads(Layout.preset("flashinfer.HND", SPEC, 6, 2).to_json())
    d["shard"] = {"heads": [0, 1, 2, 3], "of": big, "rank": big - 1, "ranks": big}
    lay = Layout.from_json(json.dumps(d))
    with pytest.raises(KVABIError, match=r"sources\[0\].shard.ranks"):
        check_group([lay.shard])
    assert time.perf_counter() - t < 1.0
