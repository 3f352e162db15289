"""Layouts under hostile input: int64-checked arithmetic, strict types, block regions in
O(blocks asked), and views that never reach past the memory they were given."""
from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from kvabi import KVABIError, KVCache, KVSpec, Layout
from kvabi.memory.views import allocate_numpy

SPEC = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
BASE = dict(order=("B", "N", "H", "D"), sizes={"B": 3, "N": 4, "H": 2, "D": 8},
            dtype="float32")


def make(**over):
    return Layout(**{**BASE, **over})


@pytest.mark.parametrize("over,field", [
    (dict(extents=False), "extents"),
    (dict(extents=[("D", 16)]), "extents"),
    (dict(extents={"D": 16.0}), "extents.D"),
    (dict(extents={"D": True}), "extents.D"),
    (dict(sizes={"B": 3, "N": 4, "H": 2, "D": True}), "sizes.D"),
    (dict(sizes={"B": 3.0, "N": 4, "H": 2, "D": 8}), "sizes.B"),
    (dict(sizes={"B": "3", "N": 4, "H": 2, "D": 8}), "sizes.B"),
    (dict(sizes={"N": 4, "H": 2, "D": 8}), "sizes.B"),
    (dict(order="BNHD"), "order"),
    (dict(order=("B", "N", "H", 4)), "order"),
    (dict(strides={"B": 256, "N": 64, "H": 32, "D": 4.0}), "strides.D"),
    (dict(strides={"B": 256, "N": 64, "H": 32, "D": True}), "strides.D"),
    (dict(plane_bytes=True), "plane_bytes"),
    (dict(plane_bytes=4096.0), "plane_bytes"),
    (dict(packing=True), "packing"),
    (dict(packing=2.0), "packing"),
    (dict(folds="HD"), "folds"),
    # an empty fold or one of one axis (the thorough fuzz found [[]] raising IndexError)
    (dict(folds=[[]]), "folds"),
    (dict(folds=[["H"]]), "folds"),
    (dict(folds=[[], ["H", "D"]]), "folds"),
    (dict(name=5), "name"),
    (dict(dtype=["float32"]), "dtype"),
])
def test_constructor_types_are_strict(over, field):
    with pytest.raises(KVABIError) as info:
        make(**over)
    assert str(info.value).startswith(field), str(info.value)


def test_numpy_integers_are_welcome_and_stored_as_python_ints():
    layout = make(sizes={"B": np.int64(3), "N": np.int32(4), "H": 2, "D": 8})
    assert all(type(v) is int for v in layout.sizes.values())
    assert Layout.from_json(layout.to_json()) == layout


@pytest.mark.parametrize("sizes,field", [
    # each product fits int64 in isolation but the plane does not
    ({"B": 2**32, "N": 2**32, "H": 1, "D": 1}, "sizes"),
    # np.prod over these wraps to a small positive number; exact arithmetic refuses
    ({"B": 2**61, "N": 8, "H": 1, "D": 1}, "sizes"),
    ({"B": 2**63 - 1, "N": 1, "H": 1, "D": 1}, "sizes"),
])
def test_spans_beyond_int64_are_refused_at_construction(sizes, field):
    with pytest.raises(KVABIError, match=f"^{field}: .*int64"):
        make(sizes=sizes)


def test_strides_reaching_2_63_are_refused():
    with pytest.raises(KVABIError, match="^strides: .*int64"):
        make(sizes={"B": 3, "N": 4, "H": 2, "D": 8},
             strides={"B": 2**62, "N": 64, "H": 32, "D": 4})
    with pytest.raises(KVABIError, match="^strides.B: must be <= "):
        make(strides={"B": 2**63, "N": 64, "H": 32, "D": 4})


def test_total_over_all_planes_must_fit_int64():
    # one plane of 2**40 bytes fits; 2**24 of them do not
    with pytest.raises(KVABIError, match="^sizes: .*all 16777216 planes.*int64"):
        Layout(order=("B", "N", "H", "D"), planes=("L",), dtype="int8",
               sizes={"L": 2**24, "B": 2**40, "N": 1, "H": 1, "D": 1})


def test_representable_extremes_are_exact():
    big = Layout(order=("B", "N", "H", "D"), planes=("L",), dtype="int8",
                 sizes={"L": 2**22, "B": 2**40, "N": 1, "H": 1, "D": 1})
    assert big.total_nbytes == 2**62 and big.plane_nbytes == 2**40
    assert big.byte_offset(layer=2**22 - 1, block=2**40 - 1) == (2**22 - 1, 2**40 - 1)
    assert Layout.from_json(big.to_json()) == big


def test_block_regions_costs_the_blocks_asked_not_num_blocks():
    layout = Layout(order=("B", "N", "H", "D"), dtype="int8",
                    sizes={"B": 2**40, "N": 1, "H": 1, "D": 1})
    layout.block_regions([1])  # warm up (first-call imports allocate too)
    tracemalloc.start()
    try:
        regions = layout.block_regions([0, 2**40 - 1, 7])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert regions == [(0, 0, 1), (0, 7, 1), (0, 2**40 - 1, 1)]
    assert peak < 2**20  # np.arange(num_blocks) would be 8 TiB


@pytest.mark.parametrize("ids,field", [([1.9], "block_ids"), ([True], "block_ids"),
                                       ([[0], [1, 2]], "block_ids"), (["0"], "block_ids"),
                                       ([-1], "block_ids"), ([3], "block_ids"),
                                       ([2**64], "block_ids")])
def test_block_regions_ids_are_strict(ids, field):
    with pytest.raises(KVABIError, match=f"^{field}"):
        make().block_regions(ids)


def test_block_regions_layers_are_strict():
    layout = Layout.preset("vllm.LBHNC", SPEC, 3, 2)
    assert layout.block_regions([1], layers=range(1, 2)) == \
        layout.block_regions([1], layers=[1]) == layout.block_regions([1], layers={1})
    for bad in ([1.0], [True], [2], [-1]):
        with pytest.raises(KVABIError, match="^layers"):
            layout.block_regions([0], layers=bad)


@pytest.mark.parametrize("kw,field", [(dict(layer=1.5), "layer"), (dict(block=True), "block"),
                                      (dict(token=np.float64(1)), "token"),
                                      (dict(head=[0, 1.5]), "head"), (dict(dim="1"), "dim"),
                                      (dict(kv=2), "kv"), (dict(block=2**63), "block")])
def test_byte_offset_indices_are_strict(kw, field):
    layout = Layout.preset("flash_attn", SPEC, 3, 2)
    with pytest.raises(KVABIError, match=f"^{field}"):
        layout.byte_offset(**kw)


def test_byte_offset_accepts_integer_arrays():
    layout = Layout.preset("flash_attn", SPEC, 3, 2)
    plane, off = layout.byte_offset(layer=np.array([0, 1], np.int32), block=[2, 1], kv=1)
    # flash_attn: planes (L, KV), [B, N, H, D] float32: B stride 4 * 2 * 8 * 4 = 256
    assert plane.tolist() == [1, 3] and off.tolist() == [512, 256]


def _page_aligned():
    spec = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float32",
                  page_align=4096)
    return Layout.preset("flashinfer.NHD", spec, 3, 2)


@pytest.mark.parametrize("bad_planes,match", [
    # right shape, too little memory: the layout pads each page to 4096 bytes
    (lambda l: [np.zeros(l.plane_shape, np.float32) for _ in range(l.num_planes)],
     r"cache\[0\].*(strides|memory)"),
    # right shape, another dtype
    (lambda l: [np.zeros(l.plane_shape, np.float16) for _ in range(l.num_planes)],
     r"cache\[0\].dtype"),
    # the right strides over a buffer one element short
    (lambda l: [np.lib.stride_tricks.as_strided(
        np.zeros(l.plane_nbytes // 4 - 1, np.float32), l.plane_shape,
        [s * 4 for s in l.plane_strides]) for _ in range(l.num_planes)],
     r"cache\[0\].*memory holds only"),
    (lambda l: [np.zeros(1, np.float32)] * l.num_planes, r"cache\[0\].shape"),
    (lambda l: allocate_numpy(l)[:1], "cache: layout has 2 planes"),
    (lambda l: "planes", "cache: must be"),
])
def test_views_check_plane_memory(bad_planes, match):
    layout = _page_aligned()
    planes = bad_planes(layout)
    with pytest.raises(KVABIError, match=match):
        KVCache.wrap(layout, planes).kv_view(0, 0)
    with pytest.raises(KVABIError, match=match):
        KVCache.wrap(layout, planes).layer_view(0)


def test_views_of_sound_planes_write_inside_the_layout():
    layout = _page_aligned()
    planes = allocate_numpy(layout, fill=-1)  # a plain list, wrapped (checked)
    k = KVCache.wrap(layout, planes).kv_view(1, 1)
    k[...] = 7
    raw = np.concatenate([np.asarray(np.lib.stride_tricks.as_strided(
        p, (layout.plane_nbytes // 4,), (4,))) for p in planes])
    assert (raw == 7).sum() == 3 * 4 * 2 * 8  # exactly the layer's values, nothing else
    with pytest.raises(KVABIError, match="^layer"):
        KVCache.wrap(layout, planes).layer_view(1.0)
    with pytest.raises(KVABIError, match="^layer"):
        KVCache.wrap(layout, planes).kv_view(True, 0)


@pytest.mark.parametrize("max_bytes", ["1024", 1024.0, True, -1])
def test_max_bytes_is_strict(max_bytes):
    with pytest.raises(KVABIError, match="^max_bytes"):
        Layout.from_json(Layout.preset("flash_attn", SPEC, 3).to_json(), max_bytes=max_bytes)


def test_from_json_accepts_a_parsed_dict_with_the_same_checks():
    d = json.loads(Layout.preset("flash_attn", SPEC, 3).to_json())
    assert Layout.from_json(d).name == "flash_attn"
    with pytest.raises(KVABIError, match="^extents"):
        Layout.from_json({**d, "extents": False})
