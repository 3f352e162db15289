"""Layouts as components: every 1.x preset keeps its bytes (against offsets recorded with
the 1.x code), the component rules refuse what they must, and any component layout kvabi
accepts is sound (checked byte by byte: every element inside its plane, no byte twice)."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvabi import Component, KVABIError, KVCache, KVSpec, Layout
from kvabi.layout.check import _common_plane

DATA = Path(__file__).parent / "data"
RECORDED = np.load(DATA / "preset_offsets_1x.npz")
META = json.loads((DATA / "preset_offsets_1x.json").read_text())
L, B, N = 2, 3, 4  # the recording's sizes


def _grid(lay, H, D):
    kvn = 2 if lay.has_kv else 1
    g = np.meshgrid(np.arange(L), np.arange(B), np.arange(kvn), np.arange(N), np.arange(H),
                    np.arange(D), indexing="ij")
    return [x.ravel() for x in g]


def _case(key):
    name, kind, dt, H, D, pa = key.split("|")
    spec = KVSpec(kind=kind, block_size=N, num_kv_heads=int(H), head_dim=int(D), dtype=dt,
                  page_align=int(pa))
    return name, spec, int(H), int(D)


RECORDED_CASES = sorted(k for k, m in META.items() if "error" not in m)


@pytest.mark.parametrize("key", RECORDED_CASES)
def test_every_preset_keeps_its_1x_bytes(key):
    """Each element's (plane, byte offset), plane count and size, and the 1.x descriptor
    read back: equal to what the 1.x code gave; the component form places alike."""
    name, spec, H, D = _case(key)
    m = META[key]
    lay = Layout.preset(name, spec, B, L)
    g = _grid(lay, H, D)
    for form in (lay, lay.component_form()):
        p, o = form.byte_offset(*g)
        np.testing.assert_array_equal(np.broadcast_to(p, o.shape), RECORDED[key + "|plane"])
        np.testing.assert_array_equal(o, RECORDED[key + "|offset"])
        assert (form.num_planes, form.plane_nbytes) == (m["num_planes"], m["plane_nbytes"])
    assert Layout.from_json(json.dumps(m["json"])) == lay  # a 1.x descriptor still reads
    assert m["json"]["kvabi_abi"][0] == 1
    back = Layout.from_json(lay.component_form().to_json())
    assert back == lay.component_form() and not back.is_axis_form


@pytest.mark.parametrize("key", RECORDED_CASES)
def test_block_regions_keep_the_1x_runs(key):
    """Regions start where the 1.x regions did and are as many; they end at the last
    asked element (1.x also took the padding after it: only padded D differs), and what
    they drop is padding."""
    name, spec, H, D = _case(key)
    lay = Layout.preset(name, spec, B, L)
    g = _grid(lay, H, D)
    p, o = lay.byte_offset(*g)
    elements = {(int(a), int(b) + i) for a, b in zip(np.broadcast_to(p, o.shape), o)
                for i in range(lay.itemsize)}
    for k, old in META[key]["regions"].items():
        new = lay.block_regions([1, 2], layers=[1]) if k == "layer1" else \
            lay.block_regions(json.loads(k))
        assert [r[:2] for r in new] == [tuple(r[:2]) for r in old]
        for (pn, on, nn), (_, _, no) in zip(new, old):
            assert nn <= no
            dropped = {(pn, on + i) for i in range(nn, no)}
            assert not dropped & elements
            assert nn == no or lay.extents  # only padded D ends earlier


def test_recorded_presets_cover_every_1x_preset():
    recorded = {k.split("|")[0] for k in META}
    assert recorded >= {"vllm.LBHNC", "vllm.BLHNC", "flash_attn", "flashinfer.NHD",
                        "flashinfer.HND", "tpu.combined", "tpu.hidden", "vllm.cpu_kt",
                        "kvbm.fully_contiguous", "kvbm.layer_separate"}


# -- the rules --------------------------------------------------------------------------
REC = {"B": 96, "N": 24}  # one (block, token) record of 24 bytes, 4 tokens per block


def kv(**over):
    """key int8 x 8 | key_scale f32 | value int8 x 8 | value_scale f32 per token."""
    comps = {"key": dict(name="key", dtype="int8", count=8, strides={**REC, "E": 1}),
             "key_scale": dict(name="key_scale", dtype="float32", count=1, offset=8,
                               strides=REC),
             "value": dict(name="value", dtype="int8", count=8, offset=12,
                           strides={**REC, "E": 1}),
             "value_scale": dict(name="value_scale", dtype="float32", count=1, offset=20,
                                 strides=REC)}
    for k, v in over.items():
        if v is None:
            comps.pop(k)
        else:
            comps[k] = {**comps[k], **v}
    return list(comps.values())  # as a descriptor gives them


SIZES = {"B": 3, "N": 4, "H": 1}


def test_interleaved_record_is_accepted_and_addressed():
    lay = Layout(sizes=SIZES, components=kv(), name="rec")
    assert lay.dtype == "int8" and lay.plane_sizes == (288,)
    assert lay.element_offset("value_scale", block=2, token=3) == (0, 2 * 96 + 3 * 24 + 20)
    assert lay.byte_offset(block=1, kv=1, token=2, dim=7) == (0, 96 + 48 + 12 + 7)
    assert lay.block_regions([0, 1]) == [(0, 0, 192)]
    assert lay.block_regions([0, 2]) == [(0, 0, 96), (0, 192, 96)]
    assert lay.component_names == ("key", "value", "key_scale", "value_scale")


@pytest.mark.parametrize("over,match", [
    (dict(value=dict(offset=4)), r"^components\.value: may share bytes with components\.key"),
    (dict(key_scale=dict(offset=10)), r"^components\.key_scale\.offset: must be a multiple"),
    (dict(key=dict(strides={**REC, "E": 1, "N": 4})), r"^components\.key\.strides\.N"),
    (dict(value=None), r"^components\.value: missing"),
    (dict(key=None, key_scale=None), r"^components\.key: missing"),
    (dict(key_scale=dict(count=3, strides={**REC, "E": 4})),
     r"^components\.key_scale\.count: 3 scales must divide"),
    (dict(key_scale=dict(strides={"B": 96, "N": 24, "H": 24})),
     r"^components\.key_scale: varies along H, but key does not"),
    (dict(key=dict(strides={"N": 24, "E": 1})), r"strides: must give a stride for B"),
    (dict(value=dict(plane=2)), r"^plane_bytes: plane 1 holds no component"),
])
def test_component_rules_refuse_by_field(over, match):
    with pytest.raises(KVABIError, match=match):
        Layout(sizes=SIZES, components=kv(**over))


def test_components_leaving_their_plane_and_dtype_disagreement():
    with pytest.raises(KVABIError, match=r"^components\.value_scale: .*leaves the plane"):
        Layout(sizes=SIZES, components=kv(), plane_bytes=287)
    with pytest.raises(KVABIError, match=r"^dtype: 'float16' disagrees with components\.key"):
        Layout(sizes=SIZES, components=kv(), dtype="float16")
    with pytest.raises(KVABIError, match=r"^components: give the axis form"):
        Layout(sizes=SIZES, components=kv(), order=("B", "N", "H", "D"))
    with pytest.raises(KVABIError, match=r"^sizes\.D: a component layout"):
        Layout(sizes={**SIZES, "D": 8}, components=kv())
    with pytest.raises(KVABIError, match=r"^components\.value_scale\.plane: reaches plane 4"):
        Layout(sizes=SIZES, components=kv(value_scale=dict(plane=4)), plane_bytes=[288] * 2)


def test_packed_dtypes_index_bytes_low_nibble_first():
    comps = [Component(name="key", dtype="uint4", count=8, strides={"B": 8, "E": 1}),
             Component(name="value", dtype="uint4", count=8, offset=4,
                       strides={"B": 8, "E": 1})]
    lay = Layout(sizes={"B": 2, "N": 1, "H": 1}, components=comps)
    assert lay.element_offset("key", block=1, index=5) == (0, 8 + 2)
    assert lay.element_offset("value", index=np.arange(8))[1].tolist() == \
        [4, 4, 5, 5, 6, 6, 7, 7]
    with pytest.raises(KVABIError, match=r"^key\.count: must be even"):
        Component(name="key", dtype="int4", count=7, strides={"B": 4, "E": 1})
    view = KVCache.allocate(lay).component_view("value", 0)
    assert view.shape == (2, 1, 1, 4) and view.dtype == np.uint8


def test_keys_and_values_of_different_strides_and_counts():
    """vLLM's CPU order (keys [D, N], values [N, D]) and K/V of different head dims."""
    n, d, dv = 4, 3, 5
    comps = [Component(name="key", dtype="float32", count=d,
                       strides={"B": 4 * n * (d + dv), "N": 4, "E": 4 * n}),
             Component(name="value", dtype="float32", count=dv, offset=4 * n * d,
                       strides={"B": 4 * n * (d + dv), "N": 4 * dv, "E": 4})]
    lay = Layout(sizes={"B": 2, "N": n, "H": 1}, components=comps)
    assert lay.byte_offset(block=1, kv=0, token=2, dim=1) == (0, 128 + 4 * (1 * n + 2))
    assert lay.byte_offset(block=1, kv=1, token=2, dim=4) == (0, 128 + 48 + 4 * (2 * dv + 4))
    assert lay.size("D") == d and lay.block_regions([1]) == [(0, 128, 128)]
    with pytest.raises(KVABIError, match=r"^axis: 'N' has no one stride"):
        lay.stride("N")
    c = KVCache.allocate(lay, fill=0)
    c.kv_view(0, 1)[1, 2, 0, 4] = 7.0
    raw = c[0].view(np.float32)
    assert raw[(128 + 48) // 4 + 2 * dv + 4] == 7.0 and np.count_nonzero(raw) == 1


def test_common_plane_of_two_progressions_against_brute_force():
    rng = np.random.default_rng(0)

    class P:
        def __init__(self, planes):
            self.planes = planes
    for _ in range(3000):
        a = (int(rng.integers(0, 9)), int(rng.integers(1, 5)), int(rng.integers(1, 7)))
        b = (int(rng.integers(0, 9)), int(rng.integers(1, 5)), int(rng.integers(1, 7)))
        sa = {a[0] + i * a[1] for i in range(a[2])}
        sb = {b[0] + j * b[1] for j in range(b[2])}
        got = _common_plane(P(a), P(b))
        assert (got is None) == (not sa & sb) and (got is None or got in sa & sb)


# -- soundness of whatever is accepted ----------------------------------------------------
@st.composite
def random_components(draw):
    sizes = {"B": draw(st.integers(1, 3)), "N": draw(st.integers(1, 3)),
             "H": draw(st.integers(1, 2))}
    nl = draw(st.integers(1, 2))
    if nl > 1:
        sizes["L"] = nl
    names = draw(st.sampled_from([("key", "value"), ("key", "value", "key_scale"),
                                  ("latent",), ("latent", "latent_scale", "rope")]))
    comps = []
    for name in names:
        dtype = draw(st.sampled_from(["int8", "float16", "float32", "uint4"]))
        unit = {"int8": 1, "float16": 2, "float32": 4, "uint4": 1}[dtype]
        count = draw(st.sampled_from([1, 2, 4])) * (2 if dtype == "uint4" else 1)
        axes = ["B", "E"] + [a for a in ("N", "H") if not name.endswith("_scale") or
                             draw(st.booleans())]
        layer_planes = nl > 1 and draw(st.booleans())
        if nl > 1 and not layer_planes:
            axes.append("L")
        strides = {a: unit * draw(st.integers(1, 24)) for a in axes}
        comps.append(dict(name=name, dtype=dtype, count=count, strides=strides,
                          offset=unit * draw(st.integers(0, 12)),
                          plane=draw(st.integers(0, 1)),
                          plane_strides={"L": draw(st.integers(1, 2))} if layer_planes
                          else {}))
    return sizes, comps, draw(st.sampled_from([None, None, 4096]))


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(case=random_components())
def test_accepted_component_layouts_are_sound(case):
    """Accepted: every byte of every element of every component lies inside its plane,
    no byte belongs to two elements, offsets follow the formula of layout.md, and block
    regions hold exactly the blocks' bytes plus padding."""
    sizes, comps, pb = case
    try:
        lay = Layout(sizes=sizes, components=comps, plane_bytes=pb)
    except KVABIError:
        return
    owner = {}
    nl = sizes.get("L", 1)
    for c in lay.components:
        per = 2 if c.dtype == "uint4" else 1
        rng = {a: range(sizes.get(a, 1) if c.varies(a) else 1) for a in ("L", "B", "N", "H")}
        for l_, b, n, h, e in itertools.product(rng["L"], rng["B"], rng["N"], rng["H"],
                                                range(c.count)):
            idx = {"L": l_, "B": b, "N": n, "H": h, "E": e // per}
            plane = c.plane + l_ * c.plane_strides.get("L", 0)
            off = c.offset + sum(idx[a] * s for a, s in c.strides.items())
            assert lay.element_offset(c.name, layer=l_, block=b, token=n, head=h,
                                      index=e) == (plane, off)
            assert plane < lay.num_planes and off + c.unit <= lay.plane_size(plane)
            for i in range(c.unit):
                for nibble in ((e % 2,) if per > 1 else (0, 1)):
                    key = (plane, off + i, nibble)
                    assert key not in owner, (key, owner[key], c.name)
                    owner[key] = (c.name, (l_, b, n, h, e))
    for blocks in ([0], list(range(sizes["B"]))):
        got = {(p, o + i) for p, o, nb in lay.block_regions(blocks) for i in range(nb)}
        mine = {k[:2] for k, v in owner.items() if v[1][1] in blocks}
        others = {k[:2] for k, v in owner.items() if v[1][1] not in blocks}
        assert mine <= got and not got & others
