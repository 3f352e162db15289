"""``Layout.fingerprint()``: equal exactly when two layouts place every element alike.

The oracle is the placement itself: the (plane, byte offset) of every logical element,
enumerated through ``Layout.byte_offset`` on small layouts, with the dtype and the global
heads held; never the fingerprint's own canonical form."""
import json

import attrs
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from kvabi import KVABIError, KVSpec, Layout
from kvabi.layout.presets import PRESETS, preset_names
from kvabi.model.shard import Shard, shard_of

AXES = ("L", "B", "KV", "N", "H", "D")


def placement(layout):
    """Everything that decides where each byte lives, by enumeration."""
    sizes = tuple(layout.size(a) for a in AXES)
    grid = np.indices(sizes).reshape(len(AXES), -1)
    idx = dict(zip(AXES, grid))
    plane, off = layout.byte_offset(layer=idx["L"], block=idx["B"],
                                    kv=idx["KV"], token=idx["N"], head=idx["H"],
                                    dim=idx["D"])
    s = shard_of(layout)
    return (layout.dtype, sizes, s.heads, s.of, np.asarray(plane).tobytes(),
            np.asarray(off).tobytes())


def test_presets_placing_bytes_alike_share_it():
    spec = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")
    a, b = Layout.preset("tpu.hidden", spec, 5, 2), Layout.preset("flash_attn", spec, 5, 2)
    assert a.name != b.name and a.folds != b.folds
    assert placement(a) == placement(b) and a.fingerprint() == b.fingerprint()
    c = Layout.preset("flashinfer.NHD", spec, 5, 2)
    assert c.fingerprint() != a.fingerprint()
    assert a.fingerprint().startswith("kv2:") and len(a.fingerprint()) == 36
    # the form moves no byte: the same placement stated by components shares it
    assert a.component_form().fingerprint() == a.fingerprint()
    assert attrs.evolve(a, shard=Shard.tp(1, 2, 4)).component_form().fingerprint() == \
        attrs.evolve(a, shard=Shard.tp(1, 2, 4)).fingerprint() != a.fingerprint()


# DeepSeek's preset holds only its own MLA spec
@pytest.mark.parametrize("name", [n for n in PRESETS if n != "deepseek.fp8_ds_mla"])
def test_equal_across_a_json_round_trip(name):
    spec = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    lay = attrs.evolve(Layout.preset(name, spec, 3, 2), shard=Shard.tp(1, 4, 8))
    back = Layout.from_json(lay.to_json())
    assert back.fingerprint() == lay.fingerprint()
    renamed = attrs.evolve(lay, name="something else")
    assert renamed.fingerprint() == lay.fingerprint()


def test_known_value():
    """The canonical form is normative (specs/layout.md): a change is a new version."""
    spec = KVSpec("full", block_size=16, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    lay = Layout.preset("flashinfer.HND", spec, 8, 2)
    import hashlib

    # flashinfer.HND: planes per layer, [B, KV, H, N, D] in each; key at 0, value at 4096
    steps = '"byte_steps":[0,8192,128,2048,2],"count":64,"dtype":"bfloat16"'
    text = ('{"axes":["L","B","N","H","E"],"components":['
            '{' + steps + ',"name":"key","offset":0,"plane":0,"plane_step":1},'
            '{' + steps + ',"name":"value","offset":4096,"plane":0,"plane_step":1}],'
            '"heads":[0,1],"of":2,"sizes":[2,8,16,2],"v":"kv2"}')
    assert lay.fingerprint() == "kv2:" + hashlib.sha256(text.encode()).hexdigest()[:32]


# -- mutated descriptors -----------------------------------------------------------------------
SPECS = [KVSpec("full", block_size=n, num_kv_heads=h, head_dim=d, dtype=t)
         for n, h, d, t in ((2, 2, 4, "float16"), (3, 1, 4, "float32"), (2, 2, 2, "int8"),
                            (1, 3, 2, "bfloat16"))]
SPECS.append(KVSpec("mla", block_size=2, num_kv_heads=1, head_dim=4, dtype="float16"))


@st.composite
def mutated(draw):
    spec = draw(st.sampled_from(SPECS))
    # the axis form's fields are mutated here
    name = draw(st.sampled_from([n for n in preset_names(spec) if n != "tpu.combined"
                                 and Layout.preset(n, spec, 1).is_axis_form]))
    lay = Layout.preset(name, spec, draw(st.integers(1, 3)), draw(st.integers(1, 2)))
    if draw(st.booleans()):
        h = lay.size("H")
        lay = attrs.evolve(lay, shard=Shard(heads=range(h, 2 * h), of=2 * h, rank=1, ranks=2))
    d = json.loads(lay.to_json())
    if draw(st.booleans()):  # explicit strides: then each one can move
        d["strides"] = {a: lay.stride(a) for a in lay.order}
    field = draw(st.sampled_from(["sizes", "strides", "order", "planes", "planes",
                                  "extents", "plane_bytes", "folds", "packing", "name",
                                  "dtype", "shard", "shard", "same"]))
    if field == "sizes":
        a = draw(st.sampled_from(sorted(d["sizes"])))
        d["sizes"][a] = max(1, d["sizes"][a] + draw(st.sampled_from([-1, 1, 2])))
    elif field == "strides" and d["strides"]:
        a = draw(st.sampled_from(sorted(d["strides"])))
        d["strides"][a] += lay.itemsize * draw(st.integers(1, 4))
    elif field == "order":
        i, j = draw(st.permutations(range(len(d["order"]))))[:2]
        d["order"][i], d["order"][j] = d["order"][j], d["order"][i]
        d["strides"], d["folds"] = None, []
    elif field == "planes":
        if len(d["planes"]) == 2 and draw(st.booleans()):  # same strides, other numbering
            d["planes"].reverse()
        elif d["planes"]:
            moved = d["planes"].pop()
            d["order"].insert(draw(st.integers(0, len(d["order"]))), moved)
        elif "L" in d["order"]:
            d["order"].remove("L")
            d["planes"] = ["L"]
        d["strides"], d["folds"] = None, []
    elif field == "extents":
        a = draw(st.sampled_from(d["order"]))
        d["extents"] = {a: d["sizes"][a] + draw(st.integers(1, 2))}
    elif field == "plane_bytes":
        d["plane_bytes"] = lay.plane_nbytes + lay.itemsize * draw(st.integers(0, 3))
    elif field == "folds":
        d["folds"] = []
    elif field == "packing":
        d["packing"] = draw(st.sampled_from([None, 1, 2]))
    elif field == "name":
        d["name"] = draw(st.sampled_from([None, "x", "flash_attn"]))
    elif field == "dtype":
        d["dtype"] = draw(st.sampled_from(["float32", "float16", "bfloat16", "int8"]))
    elif field == "shard":
        h = d["sizes"]["H"]
        d["shard"] = draw(st.sampled_from([
            None, {"heads": list(range(h))[::-1], "of": h, "rank": 0, "ranks": 1},
            {"heads": list(range(h)), "of": h + 1, "rank": 0, "ranks": 1},
            {"heads": list(range(h)), "of": h, "rank": 0, "ranks": 3}]))
    return lay, d


@settings(max_examples=12 * settings().max_examples, deadline=None)  # ci 300, thorough 4800
@given(case=mutated())
def test_fingerprint_differs_exactly_where_a_byte_moves(case):
    lay, d = case
    try:
        other = Layout.from_json(json.dumps(d))
    except KVABIError:
        assume(False)
    same = placement(lay) == placement(other)
    assert (lay.fingerprint() == other.fingerprint()) == same


# -- component layouts -------------------------------------------------------------------------
def component_placement(layout):
    """(plane, byte) of every element of every component, by enumeration, with each
    component's name and dtype and the global heads held."""
    out = []
    for c in layout.components:
        sizes = [layout.size(a) for a in ("L", "B", "N", "H")] + [c.count]
        idx = np.indices(sizes).reshape(5, -1)
        plane, off = layout.element_offset(c.name, layer=idx[0], block=idx[1], token=idx[2],
                                           head=idx[3], index=idx[4])
        out.append((c.name, c.dtype, c.count, np.asarray(plane).tobytes(),
                    np.asarray(off).tobytes()))
    s = shard_of(layout)
    return tuple(out), s.heads, s.of


COMPONENT_PRESETS = [("vllm.cpu", "bfloat16"), ("vllm.int8_per_token_head", "int8"),
                     ("flashinfer.HND.fp8_scale_plane", "float8_e4m3fn")]


@st.composite
def mutated_components(draw):
    name, dtype = draw(st.sampled_from(COMPONENT_PRESETS))
    quant = "none" if name == "vllm.cpu" else "per_token_head"
    spec = KVSpec("full", block_size=2, num_kv_heads=2, head_dim=4, dtype=dtype, quant=quant)
    lay = Layout.preset(name, spec, 2, draw(st.integers(1, 2)))
    d = json.loads(lay.to_json())
    c = draw(st.sampled_from(d["components"]))
    field = draw(st.sampled_from(["offset", "stride", "plane_bytes", "name", "same"]))
    if field == "offset":
        c["offset"] += draw(st.sampled_from([0, 4, 64, 4096]))
    elif field == "stride":
        a = draw(st.sampled_from(sorted(c["strides"])))
        c["strides"][a] += draw(st.sampled_from([0, 4, 8]))
    elif field == "plane_bytes":
        pb = d["plane_bytes"]
        d["plane_bytes"] = [p + 64 for p in pb] if isinstance(pb, list) else \
            (pb or lay.plane_nbytes) + 64
    elif field == "name":
        d["name"] = "renamed"
    return lay, d


@settings(max_examples=2 * settings().max_examples, deadline=None)
@given(case=mutated_components())
def test_component_fingerprint_differs_exactly_where_a_byte_moves(case):
    lay, d = case
    try:
        other = Layout.from_json(json.dumps(d))
    except KVABIError:
        assume(False)
    same = component_placement(lay) == component_placement(other)
    assert (lay.fingerprint() == other.fingerprint()) == same
