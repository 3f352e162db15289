"""Mutated descriptors: every preset's JSON, mutated (types, huge and negative numbers, depth,
duplicate keys, missing and extra fields), is either refused with a KVABIError or gives a
sound layout: one the descriptor's own fields describe (checked against the formulas of
specs/layout.md, written out here), all of whose sizes fit int64, with every byte offset
and every block region inside its plane.

A few hundred examples in the ``ci`` profile; 10,000 in ``thorough`` (``make thorough``).
"""
from __future__ import annotations

import itertools
import json
import math

from hypothesis import HealthCheck, event, given, settings, strategies as st

from kvabi import KVABIError, KVCache, KVSpec, Layout
from kvabi.layout.presets import AXIS_PRESETS, preset_names
from kvabi.testing.profiles import current_profile
from kvabi.memory.views import allocate_numpy

INT64_MAX = 2**63 - 1
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
            "int8": 1}
AXES = ("L", "B", "KV", "N", "H", "D")
EXAMPLES = 10_000 if current_profile() == "thorough" else 300
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])
#: block_regions is only asked for when it enumerates at most this many (plane, block) pairs
MAX_ENUMERATED = 20_000


# -- the seeds: every preset, full and MLA, several dtypes and page alignments ------------
@st.composite
def preset_docs(draw) -> dict:
    mla = draw(st.booleans())
    dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
    if mla:
        spec = KVSpec(kind="mla", block_size=draw(st.sampled_from([1, 4, 16])), num_kv_heads=1,
                      head_dim=draw(st.sampled_from([8, 24])), dtype=dtype, head_dim_v=8)
    else:
        heads = draw(st.sampled_from([1, 2, 4]))
        if dtype in ("float8_e4m3fn", "float8_e5m2", "int8"):
            heads = 2  # tpu.combined packs 4 per word: 2 * heads must be a multiple of 4
        spec = KVSpec(kind="full", block_size=draw(st.sampled_from([1, 4, 16])),
                      num_kv_heads=heads, head_dim=draw(st.sampled_from([8, 64])), dtype=dtype,
                      page_align=draw(st.sampled_from([1, 1, 256])))
    name = draw(st.sampled_from([n for n in AXIS_PRESETS if n in preset_names(spec)]))
    try:
        layout = Layout.preset(name, spec, draw(st.integers(1, 6)), draw(st.integers(1, 3)))
    except KVABIError:  # page_align on a preset that splits pages: not a seed
        layout = Layout.preset(name, spec, 3, 2) if spec.page_align == 1 else \
            Layout.preset(name, KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8,
                                       dtype=dtype), 3, 2)
    d = json.loads(layout.to_json())
    if draw(st.booleans()):  # explicit strides, so that mutations reach them
        d["strides"] = {a: layout.stride(a) for a in layout.order}
    return d


# -- hostile values ----------------------------------------------------------------------
EDGES = [0, 1, -1, 2, 3, 4, 7, 2**31 - 1, 2**31, 2**32, 2**40, 2**61, 2**62, 2**63 - 1, 2**63,
         2**64, -2**63, 10**30]
scalars = st.one_of(
    st.sampled_from(EDGES), st.integers(-2**65, 2**65), st.integers(0, 64),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.5, 1.0, 4.0, 1e300]),
    st.booleans(), st.none(), st.text(max_size=4), st.sampled_from(AXES + ("Q", "KV ")),
    st.sampled_from(sorted(ITEMSIZE) + ["float64", ""]))
values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(st.sampled_from(AXES + ("x",)), inner,
                                                     max_size=4)),
    max_leaves=8)


def paths(node, prefix=()):
    """Every (path, value) of a JSON document, containers included."""
    yield prefix, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from paths(v, prefix + (i,))


def set_at(doc, path, value):
    if not path:
        return value
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    parent[path[-1]] = value
    return doc


def delete_at(doc, path):
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    del parent[path[-1]]
    return doc


@st.composite
def mutated(draw, seeds=None):
    """(text, the mutated document or None when the text is not its json.dumps)."""
    d = draw(preset_docs() if seeds is None else seeds)
    dup = None
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 2, 3, 4]))):
        nodes = list(paths(d))
        path, node = draw(st.sampled_from(nodes))
        op = draw(st.sampled_from(["replace", "number", "number", "number", "delete", "extra",
                                   "deep", "duplicate"]))
        if op == "replace":
            d = set_at(d, path, draw(values))
        elif op == "number":
            # mostly the numbers that size things (kvabi_abi has its own replace mutations)
            ints = [(p, v) for p, v in nodes if isinstance(v, int) and not isinstance(v, bool)
                    and p[:1] != ("kvabi_abi",)]
            if ints:
                p, v = draw(st.sampled_from(ints))
                f = draw(st.sampled_from([
                    lambda v: v * 2**draw(st.integers(1, 64)), lambda v: v * 2,
                    lambda v: v + 1, lambda v: v - 1, lambda v: -v, lambda v: 0,
                    lambda v: 2**63 - v, lambda v: 2**63 // max(v, 1), lambda v: float(v),
                    lambda v: v == 1]))
                d = set_at(d, p, f(v))
        elif op == "delete" and path:
            d = delete_at(d, path)
        elif op == "extra" and isinstance(node, dict):
            node[draw(st.sampled_from(AXES + ("future", "B ", "")))] = draw(values)
        elif op == "deep":
            # (deeper documents are in the hostile corpus: 5,000 levels)
            depth = draw(st.sampled_from([1, 2, 5, 7, 8, 9, 64, 65]))
            d = set_at(d, path, json.loads("[" * depth + json.dumps(node) + "]" * depth))
        elif op == "duplicate":
            dicts = [(p, v) for p, v in nodes if isinstance(v, dict) and v]
            if dicts:
                p, v = draw(st.sampled_from(dicts))
                dup = (p, draw(st.sampled_from(sorted(v))), draw(values))
    if not isinstance(d, dict) or dup is None:
        return json.dumps(d), d
    # A duplicate key, written before the real one (a last-one-wins reader would take the
    # real one and never notice).
    path, key, value = dup
    marker = "\x00DUP\x00"
    inner = d
    try:
        for k in path:
            inner = inner[k]
    except (KeyError, IndexError, TypeError):  # a later mutation removed it
        return json.dumps(d), d
    if not isinstance(inner, dict):
        return json.dumps(d), d
    d = set_at(d, path, {marker: None, **inner})
    text = json.dumps(d).replace(json.dumps(marker) + ": null",
                                 json.dumps(key) + ": " + json.dumps(value), 1)
    return text, None


# -- the oracle ----------------------------------------------------------------------------
def is_int(v) -> bool:
    return type(v) is int


def described(d: dict) -> dict:
    """What a well-formed descriptor says, from its fields alone (specs/layout.md); raises
    AssertionError where the descriptor is not well formed, so that accepting it is a bug."""
    assert d["kvabi_abi"][0] in (1, 2) and all(is_int(x) and x >= 0 for x in d["kvabi_abi"])
    assert d["kvabi_abi"][0] == 1 or "components" not in d  # 2.x: the axis form here
    assert d["dtype"] in ITEMSIZE
    isz = ITEMSIZE[d["dtype"]]
    order, planes = d["order"], d.get("planes", [])
    assert isinstance(order, list) and isinstance(planes, list)
    assert d.get("name") is None or isinstance(d["name"], str)
    axes = order + planes
    assert len(set(axes)) == len(axes) and set(axes) <= set(AXES)
    assert {"B", "N", "H", "D"} <= set(order) and set(planes) <= {"L", "KV"}
    sizes = d["sizes"]
    assert isinstance(sizes, dict) and set(sizes) == set(axes)
    assert all(is_int(v) and v >= 1 for v in sizes.values())
    assert sizes.get("KV", 2) == 2
    extents = d.get("extents", {})
    assert isinstance(extents, dict) and set(extents) <= set(order)
    assert all(is_int(v) and v >= sizes[a] for a, v in extents.items())
    ext = {a: extents.get(a, sizes[a]) for a in order}
    if d.get("strides") is None:
        stride, s = {}, isz
        for a in reversed(order):
            stride[a], s = s, s * ext[a]
    else:
        stride = d["strides"]
        assert isinstance(stride, dict) and set(stride) == set(order)
        assert all(is_int(v) and v > 0 and v % isz == 0 for v in stride.values())
        for outer, inner in zip(order, order[1:]):
            assert stride[outer] >= ext[inner] * stride[inner]
    span = sum((ext[a] - 1) * stride[a] for a in order) + isz
    pb = d.get("plane_bytes")
    assert pb is None or (is_int(pb) and pb >= span)
    plane_nbytes = span if pb is None else pb
    num_planes = math.prod(sizes[a] for a in planes)
    total = num_planes * plane_nbytes
    assert total <= INT64_MAX and max(stride.values()) <= INT64_MAX  # representable
    for key in ("folds",):
        assert isinstance(d.get(key, []), list)
    assert d.get("packing") is None or (is_int(d["packing"]) and d["packing"] >= 1)
    return {"order": order, "planes": planes, "sizes": sizes, "stride": stride, "isz": isz,
            "plane_nbytes": plane_nbytes, "num_planes": num_planes, "total": total}


def oracle_offset(o, idx):
    plane = 0
    for a in o["planes"]:
        plane = plane * o["sizes"][a] + idx[a]
    return plane, sum(idx[a] * o["stride"][a] for a in o["order"])


def check_sound(layout: Layout, d: dict | None, max_bytes, data):
    if d is None:  # duplicate keys must never be accepted
        raise AssertionError("a descriptor with a duplicate key was accepted")
    o = described(d)
    assert layout.plane_nbytes == o["plane_nbytes"] and layout.num_planes == o["num_planes"]
    assert layout.total_nbytes == o["total"] <= INT64_MAX
    if max_bytes is not None:
        assert o["total"] <= max_bytes
    size = {a: o["sizes"].get(a, 1) for a in AXES}
    # random elements, one at a time and as one vectorized call
    elems = data.draw(st.lists(st.fixed_dictionaries(
        {a: st.integers(0, size[a] - 1) for a in AXES}), min_size=1, max_size=6))
    for e in elems:
        plane, off = layout.byte_offset(e["L"], e["B"], e["KV"], e["N"], e["H"], e["D"])
        assert (plane, off) == oracle_offset(o, e)
        assert 0 <= plane < o["num_planes"]
        assert 0 <= off and off + o["isz"] <= o["plane_nbytes"] <= INT64_MAX
    planes, offs = layout.byte_offset(*([e[a] for e in elems] for a in
                                        ("L", "B", "KV", "N", "H", "D")))
    assert [(int(p), int(x)) for p, x in zip(planes, offs)] == \
        [oracle_offset(o, e) for e in elems]
    # views over real memory (small layouts): every view lies inside its plane's buffer and
    # addresses each element where the formula says
    if o["total"] <= 2**18:
        planes = allocate_numpy(layout)
        e = elems[0]
        view = KVCache.wrap(layout, planes).kv_view(e["L"], e["KV"])
        plane, off = oracle_offset(o, e)
        start = planes[plane].__array_interface__["data"][0]
        lo = view.__array_interface__["data"][0]
        hi = lo + sum((n - 1) * st_ for n, st_ in zip(view.shape, view.strides)) + o["isz"]
        assert start <= lo and hi <= start + o["plane_nbytes"]
        elem = view[e["B"], e["N"], e["H"], e["D"]:e["D"] + 1]
        assert elem.__array_interface__["data"][0] - start == off
    # block regions, where their number is small enough to list
    blocks = data.draw(st.lists(st.integers(0, size["B"] - 1), min_size=1, max_size=4))
    layers = data.draw(st.none() | st.lists(st.integers(0, size["L"] - 1), min_size=1,
                                            max_size=3))
    cut = o["order"].index("B")
    if layers is not None and "L" in o["order"] and len(set(layers)) < size["L"]:
        cut = max(cut, o["order"].index("L"))
    enumerated = o["num_planes"] * len(blocks) * math.prod(
        size[a] for a in o["order"][:cut + 1] if a != "B")
    if enumerated > MAX_ENUMERATED:
        event("block_regions not listed (too many)")
        return
    regions = layout.block_regions(blocks, layers)
    for plane, off, n in regions:
        assert 0 <= plane < o["num_planes"]
        assert 0 <= off and n > 0 and off + n <= o["plane_nbytes"] <= INT64_MAX
    # every byte of a requested element lies in a region of its plane
    want_layers = range(size["L"]) if layers is None else layers
    for e in elems:
        e = dict(e, B=blocks[e["B"] % len(blocks)], L=list(want_layers)[e["L"] % len(want_layers)])
        plane, off = oracle_offset(o, e)
        assert any(p == plane and x <= off and off + o["isz"] <= x + n
                   for p, x, n in regions), (e, regions)


@FUZZ
@given(case=mutated(),
       max_bytes=st.sampled_from([None, None, None, 0, 4096, 2**20, 2**40]),
       as_bytes=st.booleans(), data=st.data())
def test_mutated_preset_descriptors_are_sound_or_refused(case, max_bytes, as_bytes, data):
    text, d = case
    try:
        layout = Layout.from_json(text.encode() if as_bytes else text, max_bytes=max_bytes)
    except KVABIError as e:
        event(f"refused: {str(e).split(':')[0]}")
        return
    event("accepted")
    check_sound(layout, d, max_bytes, data)



# -- component descriptors (2.0) ----------------------------------------------------------
COMPONENT_SEEDS = ("vllm.cpu", "vllm.cpu.BLHNC", "vllm.int8_per_token_head",
                   "vllm.int4_per_token_head", "flashinfer.HND.fp8_inline_scale",
                   "flashinfer.HND.fp8_scale_plane", "deepseek.fp8_ds_mla")
UNIT = {**ITEMSIZE, "uint8": 1, "int4": 1, "uint4": 1, "float4_e2m1fn": 1}
NAMES = ("key", "value", "latent", "rope", "key_scale", "value_scale", "latent_scale",
         "rope_scale")


@st.composite
def component_docs(draw) -> dict:
    name = draw(st.sampled_from(COMPONENT_SEEDS))
    if name.startswith("deepseek"):
        spec = KVSpec(kind="mla", block_size=draw(st.sampled_from([1, 2])), num_kv_heads=1,
                      head_dim=576, head_dim_v=512, dtype="bfloat16")
    else:
        spec = KVSpec(kind="full", block_size=draw(st.sampled_from([1, 2, 4])),
                      num_kv_heads=draw(st.sampled_from([1, 2])), head_dim=8,
                      dtype="float16")
    layout = Layout.preset(name, spec, draw(st.integers(1, 3)), draw(st.integers(1, 2)))
    return json.loads(layout.to_json())


def described_components(d: dict) -> dict:
    """What a well-formed component descriptor says (layout.md, Components), from its
    fields alone; AssertionError where it is not well formed."""
    assert d["kvabi_abi"][0] == 2 and "order" not in d
    sizes = d["sizes"]
    assert isinstance(sizes, dict) and set(sizes) <= {"L", "B", "N", "H"}
    assert {"B", "N", "H"} <= set(sizes) and all(is_int(v) and v >= 1 for v in sizes.values())
    comps = d["components"]
    assert isinstance(comps, list) and 1 <= len(comps) <= 16
    names = [c["name"] for c in comps]
    assert len(set(names)) == len(names) and set(names) <= set(NAMES)
    assert ({"key", "value"} <= set(names)) != ("latent" in names)
    out = []
    for c in comps:
        assert set(c) <= {"name", "dtype", "count", "offset", "strides", "plane",
                          "plane_strides"}
        unit = UNIT[c["dtype"]]
        per = 2 if c["dtype"] in ("int4", "uint4", "float4_e2m1fn") else 1
        assert is_int(c["count"]) and c["count"] >= 1 and c["count"] % per == 0
        st_ = c["strides"]
        assert set(st_) <= {"L", "B", "N", "H", "E"} and "B" in st_
        assert all(is_int(v) and v >= 1 and v % unit == 0 for v in st_.values())
        off, plane = c.get("offset", 0), c.get("plane", 0)
        assert is_int(off) and off >= 0 and off % unit == 0 and is_int(plane) and plane >= 0
        ps = c.get("plane_strides", {}).get("L", 0)
        count = {**{a: sizes.get(a, 1) for a in ("L", "B", "N", "H")}, "E": c["count"] // per}
        hi = off + sum((count[a] - 1) * s for a, s in st_.items()) + unit
        out.append(dict(c, unit=unit, per=per, count_of=count, hi=hi, ps=ps, plane=plane,
                        offset=off))
    return {"sizes": sizes, "components": out}


@FUZZ
@given(case=mutated(seeds=component_docs()), data=st.data())
def test_mutated_component_descriptors_are_sound_or_refused(case, data):
    """Mutated component descriptors are refused, or sound: each element where its fields
    say, inside its plane; and, where the layout is small enough to list, no byte held by
    two elements (checked byte by byte)."""
    text, d = case
    try:
        layout = Layout.from_json(text)
    except KVABIError as e:
        event(f"refused: {str(e).split(':')[0]}")
        return
    event("accepted")
    assert d is not None, "a descriptor with a duplicate key was accepted"
    o = described_components(d)
    total = 0
    for c in o["components"]:
        nl = o["sizes"].get("L", 1)
        last_plane = c["plane"] + (nl - 1) * c["ps"]
        assert last_plane < layout.num_planes
        for q in range(nl):
            assert c["hi"] <= layout.plane_size(c["plane"] + q * c["ps"])
        total += math.prod(c["count_of"].values())
        # random elements at the formula's place
        idx = data.draw(st.fixed_dictionaries(
            {a: st.integers(0, max(0, n - 1)) for a, n in c["count_of"].items()}))
        e = idx["E"] * c["per"]
        want = (c["plane"] + idx["L"] * c["ps"],
                c["offset"] + sum(idx["E" if a == "E" else a] * s
                                  for a, s in c["strides"].items()))
        got = layout.element_offset(c["name"], layer=idx["L"], block=idx["B"],
                                    token=idx["N"], head=idx["H"], index=e)
        assert got == want
    if total > 20_000:
        event("overlap not listed (too many elements)")
        return
    owner = {}
    for c in o["components"]:
        ranges = [range(n if (a == "E" or a in c["strides"] or
                              (a == "L" and c["ps"])) else 1)
                  for a, n in c["count_of"].items()]
        for ix in itertools.product(*ranges):
            idx = dict(zip(c["count_of"], ix))
            p = c["plane"] + idx["L"] * c["ps"]
            off = c["offset"] + sum(idx[a] * s for a, s in c["strides"].items())
            for i in range(c["unit"]):
                key = (p, off + i)
                assert key not in owner or (c["per"] > 1 and owner[key] == (c["name"], ix)), \
                    (key, owner.get(key), c["name"], ix)
                owner[key] = (c["name"], ix)
