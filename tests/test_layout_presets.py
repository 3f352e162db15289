"""Every preset is byte-exact: the anchors' tensor shapes, written element by element through
an index map taken from the anchors' own definitions, read back at ``byte_offset``."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvabi import KVABIError, KVCache, KVSpec, Layout
from kvabi.util.dtypes import numpy_dtype
from kvabi.layout.presets import AXIS_PRESETS, PRESETS, preset_names
from kvabi.layout.presets_components import CPU, QUANTIZED
from kvabi.memory.views import allocate_numpy


def anchor(name, L, B, N, H, D, dtype):
    """(plane shapes, index map) for a preset, written from the anchors' definitions:
    logical (l, b, kv, n, h, d) -> (plane, index tuple).  Independent of kvabi.layout.descriptor."""
    if name == "vllm.cpu_kt":  # keys and values as [D, N] tiles per block and head
        return [(L, B, H, 2, D, N)], lambda l, b, kv, n, h, d: (0, (l, b, h, kv, d, n))
    if name.startswith("vllm."):
        order = name.split(".")[1]  # over [L, B, H, N, C], C = (kv, d) as 2 x head_dim
        dims = {"L": L, "B": B, "H": H, "N": N, "C": 2 * D}
        shape = tuple(dims[c] for c in order)

        def idx(l, b, kv, n, h, d):
            v = {"L": l, "B": b, "H": h, "N": n, "C": kv * D + d}
            return 0, tuple(v[c] for c in order)
        return [shape], idx
    if name == "flash_attn":
        return [(B, N, H, D)] * (2 * L), lambda l, b, kv, n, h, d: (2 * l + kv, (b, n, h, d))
    if name == "flashinfer.NHD":
        return [(B, 2, N, H, D)] * L, lambda l, b, kv, n, h, d: (l, (b, kv, n, h, d))
    if name == "flashinfer.HND":
        return [(B, 2, H, N, D)] * L, lambda l, b, kv, n, h, d: (l, (b, kv, h, n, d))
    if name == "tpu.combined":
        p = 32 // (np.dtype(numpy_dtype(dtype)).itemsize * 8)
        dp = -(-D // 128) * 128

        def idx(l, b, kv, n, h, d):
            c = 2 * h + kv  # k0, v0, k1, v1, ...
            return l, (b, n, c // p, c % p, d)
        return [(B, N, 2 * H // p, p, dp)] * L, idx
    if name == "tpu.hidden":
        return [(B, N, H * D)] * (2 * L), lambda l, b, kv, n, h, d: (2 * l + kv, (b, n, h * D + d))
    if name == "kvbm.fully_contiguous":
        return [(B, L, 2, N, H * D)], lambda l, b, kv, n, h, d: (0, (b, l, kv, n, h * D + d))
    if name == "kvbm.layer_separate":
        return [(B, 2, N, H * D)] * L, lambda l, b, kv, n, h, d: (l, (b, kv, n, h * D + d))
    raise AssertionError(name)


def logical_grid(L, B, N, H, D):
    g = np.meshgrid(np.arange(L), np.arange(B), np.arange(2), np.arange(N), np.arange(H),
                    np.arange(D), indexing="ij")
    return [x.ravel() for x in g]


@pytest.mark.parametrize("name", AXIS_PRESETS)
@pytest.mark.parametrize("dtype,H,D", [("float32", 2, 8), ("float16", 1, 4),
                                       ("bfloat16", 3, 64), ("int8", 2, 16)])
def test_preset_byte_exact(name, dtype, H, D):
    L, B, N = 2, 3, 4
    spec = KVSpec(kind="full", block_size=N, num_kv_heads=H, head_dim=D, dtype=dtype)
    if name == "tpu.combined" and (2 * H) % (32 // (8 * np.dtype(numpy_dtype(dtype)).itemsize)):
        with pytest.raises(KVABIError, match="num_kv_heads"):
            Layout.preset(name, spec, B, L)
        return
    layout = Layout.preset(name, spec, B, L)
    shapes, idx = anchor(name, L, B, N, H, D, dtype)
    assert layout.num_planes == len(shapes)
    assert all(layout.plane_shape == s for s in shapes)
    dt = numpy_dtype(dtype)
    planes = [np.zeros(s, dt) for s in shapes]
    l, b, kv, n, h, d = logical_grid(L, B, N, H, D)
    # A distinct code per element (exact in every dtype: codes wrap inside the exact range).
    period = {"float32": 1 << 24, "float16": 2048, "bfloat16": 256, "int8": 127}[dtype]
    code = np.arange(l.size) % period + 1
    plane_no, index = idx(l, b, kv, n, h, d)
    plane_no = np.broadcast_to(plane_no, l.shape)
    for p in range(len(planes)):
        m = plane_no == p
        planes[p][tuple(i[m] for i in index)] = code[m].astype(dt)
    got_plane, off = layout.byte_offset(layer=l, block=b, kv=kv, token=n, head=h, dim=d)
    assert (got_plane == plane_no).all()
    for p in range(len(planes)):
        raw = planes[p].view(np.uint8).ravel()
        assert layout.plane_nbytes == raw.size
        m = got_plane == p
        offs = off[m][:, None] + np.arange(layout.itemsize)
        vals = raw[offs].copy().view(dt).ravel()
        np.testing.assert_array_equal(vals, code[m].astype(dt))
    # kv_view reads the same elements, layer_view gives the per-layer tensors.
    for layer, k in itertools.product(range(L), range(2)):
        v = KVCache.wrap(layout, planes).kv_view(layer, k)
        m = (l == layer) & (kv == k)
        np.testing.assert_array_equal(v[b[m], n[m], h[m], d[m]], code[m].astype(dt))
        views = KVCache.wrap(layout, planes).layer_view(layer)
        assert len(views) == (2 if "KV" in layout.planes else 1)


@pytest.mark.parametrize("name", [n for n in AXIS_PRESETS if not n.startswith("tpu.") and
                                  n not in ("flash_attn", "flashinfer.NHD", "flashinfer.HND")])
def test_mla_presets_have_one_latent_plane(name):
    spec = KVSpec(kind="mla", block_size=4, num_kv_heads=1, head_dim=12, head_dim_v=8,
                  dtype="float32")
    layout = Layout.preset(name, spec, 3, 2)
    assert not layout.has_kv
    assert layout.total_nbytes == 2 * 3 * 4 * 12 * 4
    planes = allocate_numpy(layout)
    v = KVCache.wrap(layout, planes).kv_view(1, 0)
    v[...] = np.arange(v.size, dtype=np.float32).reshape(v.shape)
    plane, off = layout.byte_offset(layer=1, block=2, token=3, dim=11)
    raw = planes[plane].view(np.uint8).ravel()
    assert raw[off:off + 4].view(np.float32)[0] == v[2, 3, 0, 11]


@pytest.mark.parametrize("name", ["flash_attn", "tpu.combined", "flashinfer.HND"])
def test_mla_refused_where_kv_is_required(name):
    spec = KVSpec(kind="mla", block_size=4, num_kv_heads=1, head_dim=12, head_dim_v=8)
    with pytest.raises(KVABIError, match="MLA"):
        Layout.preset(name, spec, 3)


def test_page_align_pads_each_page():
    spec = KVSpec(kind="full", block_size=4, num_kv_heads=1, head_dim=6, dtype="float16",
                  page_align=256)
    layout = Layout.preset("flashinfer.NHD", spec, 3)
    assert layout.stride("B") == 256 == spec.page_bytes
    assert not layout.is_c_contiguous
    planes = allocate_numpy(layout)
    k = KVCache.wrap(layout, planes).kv_view(0, 1)
    k[2, 3, 0, 5] = 7
    _, off = layout.byte_offset(block=2, kv=1, token=3, head=0, dim=5)
    assert off == 2 * 256 + (4 + 3) * 6 * 2 + 5 * 2
    flat = np.lib.stride_tricks.as_strided(planes[0], (layout.plane_nbytes // 2,), (2,))
    assert flat[off // 2] == 7 and np.count_nonzero(flat) == 1
    with pytest.raises(KVABIError, match="page_align"):
        Layout.preset("flash_attn", spec, 3)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(AXIS_PRESETS + tuple(CPU)), L=st.integers(1, 3), B=st.integers(1, 6),
       data=st.data())
def test_block_regions_cover_exactly_the_blocks(name, L, B, data):
    """Regions hold every byte of the chosen blocks and no byte of any other element
    (brute force over byte_offset; padding between elements may be held) and are the
    fewest: no two regions touch."""
    spec = KVSpec(kind="full", block_size=2, num_kv_heads=2, head_dim=4, dtype="float32")
    layout = Layout.preset(name, spec, B, L)
    blocks = data.draw(st.lists(st.integers(0, B - 1), unique=True, max_size=B))
    layers = data.draw(st.none() | st.lists(st.integers(0, L - 1), unique=True, min_size=1))
    regions = layout.block_regions(blocks, layers)

    def element_bytes(lays, blks):
        out = set()
        for l_, b_ in itertools.product(lays, blks):
            g = np.meshgrid(np.arange(2), np.arange(2), np.arange(2), np.arange(4),
                            indexing="ij")
            p, o = layout.byte_offset(l_, b_, *[x.ravel() for x in g])
            for pp, oo in zip(np.broadcast_to(p, o.shape), o):
                out.update((int(pp), int(oo) + i) for i in range(4))
        return out

    want = element_bytes(range(L) if layers is None else layers, blocks)
    everything = element_bytes(range(L), range(B))
    got = set()
    for p, o, nbytes in regions:
        got.update((p, o + i) for i in range(nbytes))
    assert got >= want and not (got - want) & everything
    if not layout.extents:
        assert got == want
    ends = {(p, o + nb) for p, o, nb in regions}
    assert not any((p, o) in ends for p, o, _ in regions), "adjacent regions not merged"
    if layout.is_block_contiguous and layers is None:
        assert len(regions) <= layout.num_planes * max(1, len(blocks))


def test_cross_layer_blocks_need_one_region_per_block_run():
    spec = KVSpec(kind="full", block_size=16, num_kv_heads=8, head_dim=128)
    per_layer = Layout.preset("vllm.LBHNC", spec, 1000, 32)
    cross = Layout.preset("vllm.BLHNC", spec, 1000, 32)
    blocks = [3, 7, 8, 9, 500]
    assert len(cross.block_regions(blocks)) == 3
    assert len(per_layer.block_regions(blocks)) == 32 * 3
    assert preset_names(spec) == tuple(n for n in PRESETS if n not in QUANTIZED)


def test_page_align_counts_head_dim_padding():
    """tpu.combined pads D to 128: the page to align is the padded one."""
    spec = KVSpec(kind="full", block_size=4, num_kv_heads=1, head_dim=64, dtype="float32",
                  page_align=3000)
    layout = Layout.preset("tpu.combined", spec, 2)
    assert layout.stride("B") == 3000 * 2  # 4 tokens * 2 (k, v) * 128 * 4 bytes = 4096
    planes = allocate_numpy(layout)
    KVCache.wrap(layout, planes).kv_view(0, 1)[1, 3, 0, 63] = 5
    flat = np.lib.stride_tricks.as_strided(planes[0], (layout.plane_nbytes // 4,), (4,))
    assert flat[(6000 + 3 * 1024 + 512 + 63 * 4) // 4] == 5


@pytest.mark.parametrize("args,field", [((True, 1), "num_blocks"), ((4.0, 1), "num_blocks"),
                                        ((4, False), "num_layers"), ((0, 1), "num_blocks"),
                                        ((4, 2**63), "num_layers")])
def test_preset_counts_are_strict(args, field):
    spec = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8)
    with pytest.raises(KVABIError, match=f"^{field}"):
        Layout.preset("flash_attn", spec, *args)


def test_preset_too_large_for_int64_is_refused():
    spec = KVSpec(kind="full", block_size=2**20, num_kv_heads=2**10, head_dim=2**10,
                  dtype="float32")
    with pytest.raises(KVABIError, match="int64"):
        Layout.preset("vllm.LBHNC", spec, 2**31, 32)
