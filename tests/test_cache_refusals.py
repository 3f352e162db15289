"""Bad input at the cache and layout entry points refused by name (issue classes 2, 3, 4, 6
and 10): meta planes, a cache of another framework, read-only planes, allocate's layout and
fill, replace_planes' keys and planes, non-integer layers at a cached view, a descriptor's
size field that would size the work, and descriptor numbers named by their field."""
from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvabi
from kvabi import CommonAttentionMetadata, KVABIError, KVCache, KVSpec, Layout
from kvabi.layout.descriptor import MAX_BLOCK_REGIONS
import kvabi.memory.cache as cache_mod

torch = pytest.importorskip("torch")

SPEC = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
CROSS = Layout.preset("vllm.BLHNC", SPEC, 4, 2)
SPLIT = Layout.preset("flash_attn", SPEC, 4, 2)


def _step(backend, layout, fw="numpy"):
    meta = CommonAttentionMetadata.from_lengths([3], [0], [[0]], 4, num_blocks=4)
    k = np.ones((3, 2, 8), np.float32)
    if fw == "torch":
        k = torch.from_numpy(k)
    return k, backend.plan(meta, SPEC, layout, num_q_heads=2)


def test_meta_planes_are_refused_at_wrap_and_allocate():
    meta = torch.empty(CROSS.plane_shape, device="meta")
    with pytest.raises(KVABIError, match=r"^cache\[0\].device: a meta tensor"):
        KVCache.wrap(CROSS, [meta])
    with pytest.raises(KVABIError, match=r"^cache\[0\].device"):
        KVCache.allocate(CROSS, "torch", device="meta")


@pytest.mark.parametrize("name,fw,given_fw", [("reference", "numpy", "torch"),
                                              ("example.torch", "torch", "numpy")])
def test_a_cache_of_another_framework_is_refused_by_name(name, fw, given_fw):
    backend = kvabi.get_backend(name)
    k, plan = _step(backend, CROSS, fw)
    cache = KVCache.allocate(CROSS, given_fw)
    for call in (lambda: backend.write_kv(plan, cache, key=k, value=k),
                 lambda: backend.attention(plan, cache, query=k)):
        with pytest.raises(KVABIError, match=f"^cache: {name} takes {fw} planes, got a "
                                             f"cache of {given_fw} planes"):
            call()


def test_reference_write_into_read_only_planes_is_refused():
    ref = kvabi.get_backend("reference")
    planes = [p.copy() for p in KVCache.allocate(CROSS)]
    for p in planes:
        p.flags.writeable = False
    k, plan = _step(ref, CROSS)
    with pytest.raises(KVABIError, match="read-only"):
        ref.write_kv(plan, KVCache.wrap(CROSS, planes), key=k, value=k)


@pytest.mark.parametrize("layout,match", [(None, "NoneType"), ("flashinfer.HND", "preset name"),
                                          (SPEC, "KVSpec")])
def test_allocate_needs_a_layout(layout, match):
    with pytest.raises(KVABIError, match=f"^layout: must be a kvabi.Layout.*{match}"):
        KVCache.allocate(layout)
    with pytest.raises(KVABIError, match="^layout"):
        kvabi.get_backend("reference").allocate(layout)


@pytest.mark.parametrize("fill", ["a", 300, -1, 1.5, True, None, 2**70])
def test_allocate_fill_is_a_byte(fill):
    with pytest.raises(KVABIError, match="^fill: must"):
        KVCache.allocate(CROSS, fill=fill)


@pytest.mark.parametrize("fw", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_allocate_fill_sets_every_byte(fw, dtype):
    if fw == "jax":
        pytest.importorskip("jax")
    spec = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    layout = Layout.preset("vllm.BLHNC", spec, 2, 1)
    c = KVCache.allocate(layout, fw, fill=0xA5)
    raw = np.ascontiguousarray(kvabi.tensors.to_numpy(c[0])).view(np.uint8)
    assert raw.size == layout.plane_nbytes and (raw == 0xA5).all()


@pytest.mark.parametrize("key,plane,match", [
    (5, None, r"^updates: keys must be plane indices in \[0, 4\), got 5"),
    ("0", None, "^updates: keys"), (-1, None, "^updates: keys"), (True, None, "^updates: keys"),
    (0, [1, 2], r"^cache\[0\]: must be a numpy array"),
    (0, "neg", r"^cache\[0\].strides"), (0, "step", r"^cache\[0\].strides"),
    (0, "short", r"^cache\[0\]: the layout addresses")])
def test_replace_planes_runs_the_full_check(key, plane, match):
    c = KVCache.allocate(SPLIT)
    isz = 4
    shape, strides = SPLIT.plane_shape, SPLIT.plane_strides
    buf = np.zeros(2 * SPLIT.plane_nbytes // isz, np.float32)
    if plane is None:
        plane = c[0]
    elif plane == "neg":  # right shape, runs backwards from the end of its memory
        last = sum((n - 1) * s for n, s in zip(shape, strides))
        plane = np.lib.stride_tricks.as_strided(buf[last:], shape, [-s * isz for s in strides])
    elif plane == "step":  # steps over every other element of a wider buffer
        plane = np.lib.stride_tricks.as_strided(buf, shape, [2 * s * isz for s in strides])
    elif plane == "short":
        plane = np.lib.stride_tricks.as_strided(buf[-10:], shape, [s * isz for s in strides])
    with pytest.raises(KVABIError, match=match):
        c.replace_planes({key: plane})
    with pytest.raises(KVABIError, match="^updates: must be a mapping"):
        c.replace_planes([(0, c[0])])
    assert c.replace_planes({3: c[3]})[3] is c[3]


@pytest.mark.parametrize("layer", [[0], 1.0, True, "1", None])
def test_view_layer_must_be_an_integer_even_when_cached(layer):
    for fw in ("numpy", "torch"):
        c = KVCache.allocate(CROSS, fw)
        c.kv_view(1, 0), c.layer_view(1), c.kv_view(0, 0), c.layer_view(0)
        with pytest.raises(KVABIError, match="^layer: must be an integer"):
            c.kv_view(layer, 0)
        with pytest.raises(KVABIError, match="^layer: must be an integer"):
            c.layer_view(layer)
        with pytest.raises(KVABIError, match="^kv: must be an integer"):
            c.kv_view(0, 1.0)
        assert c.kv_view(np.int64(1), np.int32(0)) is c.kv_view(1, 0)


def test_a_view_lookup_stays_cheap():
    """Not a timing assert: the cached path does no layout work (a lookup and two
    fingerprint comparisons), shown by counting the layout calls it makes."""
    c = KVCache.allocate(CROSS, "torch")
    c.kv_view(1, 1)
    calls = []
    orig = cache_mod.component_view
    try:
        cache_mod.component_view = lambda *a, **k: calls.append(a) or orig(*a, **k)
        for _ in range(3):
            c.kv_view(1, 1)
    finally:
        cache_mod.component_view = orig
    assert calls == []


def test_torch_plane_changed_after_wrap_is_detected():
    c = KVCache.allocate(SPLIT, "torch")
    c.check_unchanged()
    c[2].set_(torch.zeros(4).untyped_storage())
    c.check_unchanged([0, 1, 3])
    with pytest.raises(KVABIError, match=r"^cache\[2\]: the plane changed after KVCache.wrap"):
        c.check_unchanged()
    with pytest.raises(KVABIError, match=r"^cache\[2\]"):
        c.kv_view(1, 0)  # plane 2 holds layer 1's keys
    # storage torch allocated (host planes from KVCache.allocate sit on numpy memory, whose
    # storage torch refuses to resize at all)
    c2 = KVCache.wrap(SPLIT, [torch.zeros(p.untyped_storage().nbytes(), dtype=torch.uint8)
                              .view(p.dtype).as_strided(p.shape, p.stride())
                              for p in KVCache.allocate(SPLIT, "torch")])
    c2.kv_view(0, 0)
    c2[0].untyped_storage().resize_(0)
    with pytest.raises(KVABIError, match=r"^cache\[0\]"):
        c2.kv_view(0, 0)


# -- class 6: work follows the output, not a size field ------------------------------------
def _desc(order, **sizes):
    return json.dumps({"kvabi_abi": [1, 1], "dtype": "int8", "order": order, "sizes": sizes})


@pytest.mark.parametrize("order", [["N", "B", "H", "D"], ["H", "N", "B", "D"],
                                   ["B", "N", "H", "D"]])
def test_a_huge_size_field_does_not_size_the_work(order):
    layout = Layout.from_json(_desc(order, B=1, N=2**32, H=1, D=1))
    assert layout.block_regions([0]) == [(0, 0, 2**32)]  # one region, found without 2**32 rows


def test_more_pieces_than_the_limit_are_refused_by_name():
    layout = Layout.from_json(_desc(["N", "B", "H", "D"], B=2, N=2**32, H=1, D=1))
    with pytest.raises(KVABIError, match=f"^block_ids: .*MAX_BLOCK_REGIONS = {MAX_BLOCK_REGIONS}"):
        layout.block_regions([0])


def _naive_regions(layout, blocks, layers):
    """The definition, byte by byte: every byte of every element of the blocks (and
    layers) asked, grouped into runs where the bytes between two asked bytes of a plane
    hold no byte of another element (of any block, layer or component)."""
    asked, other = set(), set()
    lay_asked = set(range(layout.num_layers) if layers is None else layers)
    for l_, b_, kv, n, h, d in itertools.product(
            range(layout.num_layers), range(layout.num_blocks), range(2 if layout.has_kv
                                                                      else 1),
            range(layout.size("N")), range(layout.size("H")), range(layout.size("D"))):
        p, o = layout.byte_offset(l_, b_, kv, n, h, d)
        mine = b_ in set(blocks) and l_ in lay_asked
        (asked if mine else other).update((p, o + i) for i in range(layout.itemsize))
    out = []
    for p, o in sorted(asked):
        if out and out[-1][0] == p and not any((p, x) in other for x in
                                               range(out[-1][1] + out[-1][2], o)):
            out[-1][2] = o + 1 - out[-1][1]
        else:
            out.append([p, o, 1])
    return [tuple(r) for r in out]


@settings(max_examples=150, deadline=None)
@given(order=st.permutations(["L", "B", "N", "H", "D"]), sizes=st.lists(
    st.integers(1, 3), min_size=5, max_size=5), pad=st.integers(0, 2), data=st.data())
def test_folded_block_regions_equal_the_enumerated_definition(order, sizes, pad, data):
    sz = dict(zip(["L", "B", "N", "H", "D"], sizes))
    ext = {a: sz[a] + pad for a in data.draw(st.sets(st.sampled_from(order), max_size=2))}
    layout = Layout(order=order, sizes=sz, dtype="float16", extents=ext or None)
    blocks = data.draw(st.lists(st.integers(0, sz["B"] - 1), min_size=1, max_size=4))
    layers = data.draw(st.none() | st.lists(st.integers(0, sz["L"] - 1), min_size=1,
                                            max_size=3))
    assert layout.block_regions(blocks, layers) == _naive_regions(layout, blocks, layers)


# -- class 10: descriptor numbers named by their field -------------------------------------
@pytest.mark.parametrize("text,field", [
    ('"L": 99999999999999999999', "sizes.L"), ('"L": NaN', "sizes.L"),
    ('"L": -Infinity', "sizes.L"), ('"L": 1e999', "sizes.L")])
def test_descriptor_numbers_are_named_by_field(text, field):
    doc = ('{"kvabi_abi": [1, 1], "dtype": "int8", "order": ["L", "B", "N", "H", "D"], '
           '"sizes": {"B": 1, "N": 1, "H": 1, "D": 1, ' + text + '}}')
    with pytest.raises(KVABIError, match=f"^{field}: "):
        Layout.from_json(doc)


def test_check_unchanged_takes_plane_indices():
    c = KVCache.allocate(SPLIT)
    c.check_unchanged([0, np.int64(3)])
    for bad in ([4], [-1], [1.0], ["0"], [True]):
        with pytest.raises(KVABIError, match=r"^planes: must hold plane indices in \[0, 4\)"):
            c.check_unchanged(bad)


@pytest.mark.parametrize("device,match", [("nonsense", r"^device: not a torch device"),
                                          ([0], r"^device: not a torch device"),
                                          ("cuda:0" if not torch.cuda.is_available()
                                           else "cuda:4096", r"^device: cannot allocate")])
def test_allocate_names_a_device_it_cannot_use(device, match):
    with pytest.raises(KVABIError, match=match):
        KVCache.allocate(CROSS, "torch", device=device)
    assert KVCache.allocate(CROSS, "torch", device="cpu")[0].device.type == "cpu"


@pytest.mark.parametrize("planes", [5, "01", {0: 1}])
def test_check_unchanged_takes_a_list_of_plane_indices(planes):
    with pytest.raises(KVABIError, match="^planes: must be a list of plane indices"):
        KVCache.allocate(CROSS).check_unchanged(planes)
    KVCache.allocate(CROSS).check_unchanged(np.array([0]))
