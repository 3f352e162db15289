"""kvabi.probe.infer_layout: the layout an engine's write really produces.

The writers here are built from a layout's offset formula (``kvabi.testing.writers``) or
written out by hand; the check is the whole grid: every element's (plane, byte offset) in
the inferred layout equals the truth's.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvabi import KVABIError, KVCache, KVSpec, Layout
from kvabi import tensors as kvabi_tensors
from kvabi.util.dtypes import DTYPES
from kvabi.layout.presets import preset_names
from kvabi.probe import infer_layout, placement_difference
from kvabi.testing.strategies import random_layouts
from kvabi.testing.writers import layout_writer
from kvabi.memory.views import allocate_numpy

L, B = 3, 5


def grid(layout):
    """(plane, offset) of every element, from the layout's own addressing."""
    ax = [np.arange(layout.num_layers), np.arange(layout.num_blocks),
          np.arange(2 if layout.has_kv else 1), np.arange(layout.size("N")),
          np.arange(layout.size("H")), np.arange(layout.size("D"))]
    l, b, kv, n, h, d = np.meshgrid(*ax, indexing="ij")
    p, o = layout.byte_offset(layer=l, block=b, kv=kv, token=n, head=h, dim=d)
    return np.broadcast_to(p, o.shape), o


def assert_same_bytes(truth, got):
    tp, to = grid(truth)
    gp, go = grid(got)
    assert np.array_equal(tp, gp) and np.array_equal(to, go), (truth, got)


def probe(truth, spec, planes=None):
    planes = allocate_numpy(truth, fill=7) if planes is None else planes
    return infer_layout(spec, planes, layout_writer(truth, planes), num_blocks=truth.num_blocks,
                        num_layers=truth.num_layers)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_preset_every_dtype(dtype):
    spec = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    for name in preset_names(spec):
        truth = Layout.preset(name, spec, B, L)
        got = probe(truth, spec)
        assert_same_bytes(truth, got)
        assert got.name is not None  # a preset places them alike: it is named


def test_mla_presets():
    spec = KVSpec(kind="mla", block_size=4, num_kv_heads=1, head_dim=12, dtype="bfloat16")
    for name in preset_names(spec):
        truth = Layout.preset(name, spec, B, L)
        assert_same_bytes(truth, probe(truth, spec))


def test_page_aligned_preset_keeps_its_padding():
    spec = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float16",
                  page_align=1024)
    truth = Layout.preset("flashinfer.HND", spec, B, L)
    got = probe(truth, spec)
    assert_same_bytes(truth, got)
    assert got.stride("B") == 1024


@st.composite
def random_case(draw):
    dtype = draw(st.sampled_from(DTYPES))
    mla = draw(st.booleans())
    spec = KVSpec(kind="mla" if mla else "full", block_size=draw(st.sampled_from([1, 2, 3, 4])),
                  num_kv_heads=1 if mla else draw(st.integers(1, 3)),
                  head_dim=draw(st.sampled_from([1, 2, 4, 6])), dtype=dtype)
    nb, nl = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    return spec, draw(random_layouts(spec, nb, nl))


@given(random_case())
def test_random_layouts(case):
    spec, truth = case
    got = probe(truth, spec)
    assert_same_bytes(truth, got)
    assert placement_difference(truth, got) is None


def test_flat_buffer_and_torch_planes():
    torch = pytest.importorskip("torch")
    spec = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    truth = Layout.preset("vllm.BLNHC", spec, B, L)
    flat = [torch.zeros(truth.plane_nbytes, dtype=torch.uint8)]  # the engine's own buffer
    assert_same_bytes(truth, probe(truth, spec, flat))
    truth = Layout.preset("flash_attn", spec, B, L)
    planes = [torch.zeros(truth.plane_shape, dtype=torch.bfloat16) for _ in range(2 * L)]
    assert_same_bytes(truth, probe(truth, spec, planes))


# -- writers no layout describes -------------------------------------------------------
SPEC = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")


def engine(fn):
    """A numpy cache [L, B, N, H, 2, D] written by ``fn(cache, layer, b, n, k, v)``."""
    cache = np.zeros((L, B, 4, 2, 2, 8), np.float32)

    def write(layer, slots, key, value):
        fn(cache, layer, slots // 4, slots % 4, key, value)
    return [cache], write


def run(fn):
    planes, write = engine(fn)
    return infer_layout(SPEC, planes, write, num_blocks=B, num_layers=L)


def test_custom_but_expressible_engine():
    def fn(c, layer, b, n, k, v):
        c[layer, b, n, :, 0], c[layer, b, n, :, 1] = k, v
    got = run(fn)
    assert got.order == ("L", "B", "N", "H", "KV", "D") and got.name == "vllm.LBNHC"


def test_tiled_dim_is_not_a_layout():
    def fn(c, layer, b, n, k, v):  # D split in two halves with N in between: [.., D/4, N, 4]
        t = c[layer].reshape(B, 2, 2, 2, 4, 4)  # [B, KV, H, D/4, N, 4]
        t[b, 0, :, :, n, :] = k.reshape(-1, 2, 2, 4)
        t[b, 1, :, :, n, :] = v.reshape(-1, 2, 2, 4)
    with pytest.raises(KVABIError, match="not affine"):
        run(fn)


def test_dropped_element():
    def fn(c, layer, b, n, k, v):
        old = c[layer, b, n, 1, 1, 3].copy()
        c[layer, b, n, :, 0], c[layer, b, n, :, 1] = k, v
        c[layer, b, n, 1, 1, 3] = old  # value head 1 dim 3 never lands
    with pytest.raises(KVABIError, match="value of layer 0, block 0, token 0, head 1, dim 3"):
        run(fn)


def test_heads_collide_ambiguous():
    def fn(c, layer, b, n, k, v):  # every head written to head 0: heads indistinguishable
        c[layer, b, n, 0, 0], c[layer, b, n, 0, 1] = k[:, 1], v[:, 1]
    with pytest.raises(KVABIError, match="found nowhere"):
        run(fn)


def test_writes_everywhere():
    def fn(c, layer, b, n, k, v):
        c[...] = 0
        c[layer, b, n, :, 0], c[layer, b, n, :, 1] = k, v
    with pytest.raises(KVABIError, match="outside the slots"):
        run(fn)


def test_converted_values():
    def fn(c, layer, b, n, k, v):
        c[layer, b, n, :, 0], c[layer, b, n, :, 1] = k * 2, v
    with pytest.raises(KVABIError, match="never wrote"):
        run(fn)


def test_values_before_keys_in_planes():
    truth = Layout.preset("flash_attn", SPEC, B, L)
    planes = allocate_numpy(truth)
    inner = layout_writer(truth, planes)

    def write(layer, slots, key, value):  # planes in [V, K] order per layer
        inner(layer, slots, value, key)
    with pytest.raises(KVABIError, match="row-major"):
        infer_layout(SPEC, planes, write, num_blocks=B, num_layers=L)


def test_refuses_jax_and_read_only():
    planes = [np.zeros(10, np.float32)]
    planes[0].flags.writeable = False
    with pytest.raises(KVABIError, match="read-only"):
        infer_layout(SPEC, planes, lambda *a: None, num_blocks=B)
    with pytest.raises(KVABIError, match="planes"):
        infer_layout(SPEC, "x", lambda *a: None, num_blocks=B)


def test_keys_dim_major_values_token_major():
    # per block-head: keys as [D, N], then values as [N, D] (vLLM CPU's "vec" kernels)
    cache = np.zeros((L, B, 2, 8 * 4 * 2), np.float32)

    def write(layer, slots, key, value):
        for i, s in enumerate(slots):
            b, n = divmod(int(s), 4)
            blk = cache[layer, b].reshape(2, 2, 32)  # [H, KV, 32]
            blk[:, 0].reshape(2, 8, 4)[:, :, n] = key[i]
            blk[:, 1].reshape(2, 4, 8)[:, n, :] = value[i]
    got = infer_layout(SPEC, [cache], write, num_blocks=B, num_layers=L)
    # two components, each with its own strides: found, and named as the preset
    key, value = got.component("key"), got.component("value")
    assert (key.offset, dict(key.strides)) == (0, {"L": B * 512, "B": 512, "N": 4, "H": 256,
                                                   "E": 16})
    assert (value.offset, dict(value.strides)) == (128, {"L": B * 512, "B": 512, "N": 32,
                                                         "H": 256, "E": 4})
    assert got.name == "vllm.cpu" and got == Layout.preset("vllm.cpu", SPEC, B, L)


def _view_writer(layout, planes):
    """An engine writing through the layout's strided torch views (no kvabi.probe code)."""
    import torch

    def write(layer, slots, key, value):
        s = torch.as_tensor(np.asarray(slots), device=planes[0].device)
        b, n = s // layout.size("N"), s % layout.size("N")
        for kv, x in enumerate([key, value]):
            view = KVCache.wrap(layout, planes).kv_view(layer, kv)
            view[b, n] = kvabi_tensors.to_torch(x, device=planes[0].device)
    return write


def _torch_planes_case(device):
    import torch

    spec = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")
    for name in ("vllm.LHBNC", "flash_attn", "tpu.combined"):
        truth = Layout.preset(name, spec, B, L)
        planes = [torch.zeros(truth.plane_nbytes, dtype=torch.uint8, device=device)
                  .view(torch.bfloat16).as_strided(truth.plane_shape, truth.plane_strides)
                  for _ in range(truth.num_planes)]
        write = _view_writer(truth, planes)
        got = infer_layout(spec, planes, write, num_blocks=B, num_layers=L)
        assert got.name == name or placement_difference(truth, got) is None
        assert_same_bytes(truth, got)


def test_torch_planes_written_through_views():
    pytest.importorskip("torch")
    _torch_planes_case("cpu")


@pytest.mark.gpu
def test_cuda_planes():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _torch_planes_case("cuda")


@pytest.mark.parametrize("dtype,rounds", [("int8", 2), ("float8_e4m3fn", 2), ("bfloat16", 1),
                                          ("float32", 1)])
def test_one_byte_dtypes_spread_markers_over_writes(dtype, rounds):
    spec = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    truth = Layout.preset("vllm.BHLNC", spec, B, L)
    planes = allocate_numpy(truth)
    inner = layout_writer(truth, planes)
    calls = []

    def write(layer, *a):
        calls.append(layer)
        inner(layer, *a)
    infer_layout(spec, planes, write, num_blocks=B, num_layers=L, samples=1)
    # discovery: 3 layers x 6 tokens x 2 x 2 heads x 8 = 576 ids, more than the ~240 digits
    # of an 8-bit dtype: one write per layer per round; the check: one token (32 ids), once
    assert len(calls) == 3 * rounds + 1


def test_layers_not_probed_are_checked_on_a_fresh_sample():
    # layers 0, 1 and the last follow the layout; the middle ones land one block later
    truth = Layout.preset("vllm.BLNHC", SPEC, B, 5)
    planes = allocate_numpy(truth)
    inner = layout_writer(truth, planes)

    def write(layer, slots, key, value):
        if layer in (2, 3):
            slots = (np.asarray(slots) + 4) % (B * 4)
        inner(layer, slots, key, value)
    with pytest.raises(KVABIError, match=r"^infer_layout: the placement fitted from the probed "
                       r"tokens fails on a fresh sample \(the write is not one layout\): "
                       r"key of layer [23], block \d, token \d, head 0, dim 0 "):
        infer_layout(SPEC, planes, write, num_blocks=B, num_layers=5)
