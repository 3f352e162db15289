"""kvabi.probe.verify_layout: a few writes catch a layout that is not what the engine
writes, and pass every correct (layout, writer) pair."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvabi import KVABIError, KVSpec, Layout
from kvabi.layout.presets import preset_names
from kvabi.probe import verify_layout
from kvabi.testing.strategies import random_layouts
from kvabi.testing.writers import layout_writer
from kvabi.memory.views import allocate_numpy

L, B = 3, 6
SPEC = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e5m2", "int8"])
def test_every_correct_preset_pair_passes(dtype):
    spec = KVSpec(kind="full", block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    for name in preset_names(spec):
        layout = Layout.preset(name, spec, B, L)
        planes = allocate_numpy(layout)
        verify_layout(layout, planes, layout_writer(layout, planes), samples=6)


@given(st.sampled_from(["float16", "int8"]), st.integers(1, 3), st.data())
def test_random_correct_pairs_pass(dtype, nl, data):
    spec = KVSpec(kind="full", block_size=3, num_kv_heads=2, head_dim=4, dtype=dtype)
    layout = data.draw(random_layouts(spec, 4, nl))
    planes = allocate_numpy(layout)
    verify_layout(layout, planes, layout_writer(layout, planes))


def test_leaves_the_cache_as_it_was():
    layout = Layout.preset("vllm.LBHNC", SPEC, B, L)
    planes = allocate_numpy(layout)
    raw = planes[0].reshape(-1).view(np.uint16)
    raw[:] = np.random.default_rng(0).integers(0, 1 << 15, raw.size)
    before = raw.copy()
    verify_layout(layout, planes, layout_writer(layout, planes))
    assert np.array_equal(raw, before)


def _engine(actual, declared, transform=None):
    planes = allocate_numpy(actual)
    inner = layout_writer(actual, planes)

    def write(layer, slots, key, value):
        if transform is not None:
            layer, slots, key, value = transform(layer, slots, key, value)
        inner(layer, slots, key, value)
    return planes, write


def test_swapped_axes():
    declared = Layout.preset("vllm.LBHNC", SPEC, B, L)
    planes, write = _engine(Layout.preset("vllm.LBNHC", SPEC, B, L), declared)
    with pytest.raises(KVABIError, match=r"^key of layer 0, block 0, token 0, head 1, dim 0 "
                       r"found -96 bytes from where vllm.LBHNC puts it \(plane 0, byte 128\)"):
        verify_layout(declared, planes, write)


def test_kv_swap():
    declared = Layout.preset("flashinfer.NHD", SPEC, B, L)
    planes, write = _engine(declared, declared, lambda l, s, k, v: (l, s, v, k))
    with pytest.raises(KVABIError, match=r"^key of layer 0, block 0, token 0, head 0, dim 0 "
                       r"found 128 bytes from where flashinfer.NHD puts it"):
        verify_layout(declared, planes, write)


def test_kv_swap_across_planes():
    declared = Layout.preset("flash_attn", SPEC, B, L)
    planes, write = _engine(declared, declared, lambda l, s, k, v: (l, s, v, k))
    with pytest.raises(KVABIError, match=r"found in plane 1 at byte 0, not where flash_attn"):
        verify_layout(declared, planes, write)


def test_off_by_one_block():
    declared = Layout.preset("vllm.BLHNC", SPEC, B, L)
    bs = SPEC.block_size
    planes, write = _engine(declared, declared,
                            lambda l, s, k, v: (l, (s + bs) % (B * bs), k, v))
    with pytest.raises(KVABIError, match=r"^key of layer 0, block 0, token 0, head 0, dim 0 "
                       r"(is not where|found)"):
        verify_layout(declared, planes, write)


def test_padding_written_into():
    # D padded from 8 to 10: the engine writes two more values per head into the padding.
    spec = SPEC
    declared = Layout(order=("B", "N", "H", "KV", "D"), planes=("L",),
                      sizes={"L": L, "B": B, "N": 4, "H": 2, "KV": 2, "D": 8},
                      extents={"D": 10}, dtype="bfloat16")
    wide = Layout(order=declared.order, planes=("L",), dtype="bfloat16",
                  sizes={**declared.sizes, "D": 10})
    planes = allocate_numpy(declared)
    inner = layout_writer(wide, planes)

    def write(layer, slots, key, value):
        pad = lambda x: np.concatenate([x, x[..., :2]], axis=-1)  # noqa: E731
        inner(layer, slots, pad(key), pad(value))
    with pytest.raises(KVABIError, match=r"plane 0, byte 16 was written \(a copy of the key of "
                       r"layer 0, block 0, token 0, head 0, dim 0\), but the layout has "
                       r"padding there"):
        verify_layout(declared, planes, write)
    verify_layout(declared, planes, layout_writer(declared, planes))


def test_bad_arguments():
    layout = Layout.preset("flash_attn", SPEC, B, L)
    planes = allocate_numpy(layout)
    w = layout_writer(layout, planes)
    with pytest.raises(KVABIError, match="planes: flash_attn has 6 planes, got 5"):
        verify_layout(layout, planes[:5], w)
    with pytest.raises(KVABIError, match="samples"):
        verify_layout(layout, planes, w, samples=0)
    with pytest.raises(KVABIError, match="layout"):
        verify_layout("flash_attn", planes, w)
    with pytest.raises(KVABIError, match=r"planes\[0\]: spans"):
        verify_layout(layout, [np.zeros(4, np.uint8)] * 6, w)


def test_write_must_be_callable_and_samples_bounded():
    from kvabi.probe import infer_layout

    layout = Layout.preset("flash_attn", SPEC, B, L)
    planes = allocate_numpy(layout)
    w = layout_writer(layout, planes)
    for call in (lambda **k: verify_layout(layout, planes, **k),
                 lambda **k: infer_layout(SPEC, planes, num_blocks=B, num_layers=L, **k)):
        with pytest.raises(KVABIError, match="write: must be callable"):
            call(write=None)
        with pytest.raises(KVABIError, match="samples"):
            call(write=w, samples=1 << 30)
        with pytest.raises(KVABIError, match="samples"):
            call(write=w, samples=True)


def test_a_write_that_does_nothing():
    layout = Layout.preset("flash_attn", SPEC, B, L)
    planes = allocate_numpy(layout)
    with pytest.raises(KVABIError, match=r"^key of layer 0, block 0, token 0, head 0, dim 0 is "
                       r"not where flash_attn puts it \(plane 0, byte 0: it holds no marker"):
        verify_layout(layout, planes, lambda *a: None)
