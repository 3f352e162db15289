"""Objects kvabi checked, changed afterwards through their public surface (``specs/security.md``
section 2.5, the immutability rule): a handle's attributes, a layout's mappings, a step's
validated arrays, the planes under a handle (numpy shape/strides, torch ``set_``/
``as_strided_``), the views it handed out, and replacement planes that would reach outside
their memory.  Each change is either
refused (a KVABIError, at the change or where the object is next used) or harmless: the
planes sit between guard bytes that are part of no plane's memory, and after every write the
guards must be untouched.  Where nothing was changed, the write must land exactly where the
layout says (checked against ``Layout.byte_offset``, independently of the views).

A few hundred examples in the ``ci`` profile; 10,000 in ``thorough`` (``make thorough``).
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

import kvabi
from kvabi import CommonAttentionMetadata, KVABIError, KVCache, KVSpec, Layout
from kvabi.util.errors import FrozenError
from kvabi.layout.presets import preset_names
from kvabi.testing.profiles import current_profile

torch = pytest.importorskip("torch")

EXAMPLES = 10_000 if current_profile() == "thorough" else 300
MUTATE = settings(max_examples=EXAMPLES, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SPEC = KVSpec(kind="full", block_size=2, num_kv_heads=1, head_dim=4, dtype="float32")
GUARD = 64
POISON = 0x5A
BACKENDS = {"numpy": kvabi.get_backend("reference"), "torch": kvabi.get_backend("example.torch")}

MUTATIONS = ("none", "rebind", "layout_mapping", "replace_negative", "replace_stepping",
             "replace_shifted", "replace_other_framework", "replace_bad_key", "plane_shape",
             "plane_strides", "view_shape", "torch_set", "torch_as_strided", "meta_slots")


class Guarded:
    """The planes of ``layout`` in one buffer, each between guard bytes; each plane's memory
    (as numpy and torch see it) is only its own ``plane_nbytes`` bytes."""

    def __init__(self, layout: Layout, fw: str):
        nb = layout.plane_nbytes
        isz = layout.itemsize
        self.starts = [GUARD + i * (nb + GUARD) for i in range(layout.num_planes)]
        self.buf = np.full(self.starts[-1] + nb + GUARD, POISON, np.uint8)
        self.layout, self.fw, self.heads, self.planes = layout, fw, [], []
        for s in self.starts:
            head = np.frombuffer(memoryview(self.buf)[s:s + nb], np.uint8)
            self.buf[s:s + nb] = 0
            self.heads.append(head)
            self.planes.append(self._plane(head.view(np.float32), layout.plane_strides))

    def _plane(self, items: np.ndarray, strides, offset: int = 0):
        shape = self.layout.plane_shape
        if self.fw == "torch":
            return torch.from_numpy(items).as_strided(shape, strides, offset)
        return np.lib.stride_tricks.as_strided(items[offset:], shape,
                                               [s * 4 for s in strides])

    def guards_intact(self) -> bool:
        nb = self.layout.plane_nbytes
        mask = np.ones(self.buf.size, bool)
        for s in self.starts:
            mask[s:s + nb] = False
        return bool((self.buf[mask] == POISON).all())


@st.composite
def setups(draw):
    name = draw(st.sampled_from(preset_names(SPEC)))
    layout = Layout.preset(name, SPEC, draw(st.integers(1, 3)), draw(st.integers(1, 2)))
    fw = draw(st.sampled_from(["numpy", "torch"]))
    mutation = draw(st.sampled_from(MUTATIONS))
    plane = draw(st.integers(0, layout.num_planes - 1))
    layer = draw(st.integers(0, layout.num_layers - 1))
    warm = draw(st.booleans())  # views cached before the change
    return layout, fw, mutation, plane, layer, warm


def _mutate(g: Guarded, cache: KVCache, mutation: str, i: int, layer: int, meta):
    """Apply ``mutation``; returns (cache to use, outcome): "refused" when the change itself
    raised a KVABIError, "applied" when it took effect, "none" when there was nothing to
    change (or numpy/torch themselves refused the change)."""
    lay, fw = g.layout, g.fw
    items = g.heads[i].view(np.float32)
    strides = lay.plane_strides
    try:
        if mutation == "rebind":
            setattr(cache, "layout", Layout.preset("flash_attn", SPEC, 50, 4))
        elif mutation == "layout_mapping":
            lay.sizes["B"] = 10**6
        elif mutation == "replace_negative" and fw == "numpy":  # torch has no such strides
            # the last element first, every stride negated: the plane runs backwards
            cache = cache.replace_planes({i: _backwards(g, items)})
        elif mutation == "replace_stepping":
            cache = cache.replace_planes({i: _stepping(g, items)})
        elif mutation == "replace_shifted":  # starts one element late: its last one is past
            cache = cache.replace_planes({i: g._plane(items, strides, 1)})
        elif mutation == "replace_other_framework":
            if fw == "numpy":
                other = torch.from_numpy(items).as_strided(lay.plane_shape, strides)
            else:
                other = np.lib.stride_tricks.as_strided(items, lay.plane_shape,
                                                        [s * 4 for s in strides])
            cache = cache.replace_planes({i: other})
        elif mutation == "replace_bad_key":
            cache = cache.replace_planes({-1: cache[i]})
        elif mutation == "plane_shape":
            p = cache[i]
            if fw == "torch":
                p.resize_(p.numel())  # the storage is not resizable: only if it fits
            else:
                p.shape = (-1,)
        elif mutation in ("plane_strides", "view_shape"):
            # zero strides stay inside any memory, so numpy and torch allow them in place:
            # every element becomes the first one
            p = cache[i] if mutation == "plane_strides" else cache.kv_view(layer, 0)
            if fw == "torch":
                p.as_strided_(p.shape, (0,) * p.dim())
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    p.strides = (0,) * p.ndim
        elif mutation == "torch_set" and fw == "torch":
            small = torch.from_numpy(items[:1].copy())
            cache[i].set_(small.untyped_storage(), 0, (1,), (1,))
        elif mutation == "meta_slots":  # a validated step's slots pointed past the cache
            meta.slot_mapping[0] = lay.num_blocks * SPEC.block_size + 10**6
        elif mutation == "torch_as_strided" and fw == "torch":
            cache[i].as_strided_((1,), (1,), 1)
        else:
            return cache, "none"
    except KVABIError:
        return cache, "refused"
    except (ValueError, AttributeError, RuntimeError):
        return cache, "none"  # numpy or torch refused the change itself
    return cache, "applied"


def _backwards(g: Guarded, items):
    shape, strides = g.layout.plane_shape, g.layout.plane_strides
    last = sum((n - 1) * s for n, s in zip(shape, strides))
    return np.lib.stride_tricks.as_strided(items[last:], shape, [-s * 4 for s in strides])


def _stepping(g: Guarded, items):
    """A plane of the right shape that steps over every other element: it needs twice the
    memory it has."""
    shape, strides = g.layout.plane_shape, g.layout.plane_strides
    if g.fw == "torch":  # torch refuses strides past its storage: overlap instead
        return torch.from_numpy(items).as_strided(shape, strides[:-1] + (0,))
    return np.lib.stride_tricks.as_strided(items, shape, [2 * s * 4 for s in strides])


def _step(layout: Layout):
    """Every slot of the layout written once: each block's block_size tokens."""
    nb, bs = layout.num_blocks, SPEC.block_size
    return CommonAttentionMetadata.from_lengths([bs] * nb, [0] * nb,
                                                [[b] for b in range(nb)], bs, num_blocks=nb)


def _expected(layout: Layout, layer: int, key, value) -> list[np.ndarray]:
    """The planes (as raw float32 items) after writing ``key``/``value`` to every slot of
    ``layer``, from Layout.byte_offset (not from any view)."""
    out = [np.zeros(layout.plane_nbytes // 4, np.float32) for _ in range(layout.num_planes)]
    bs = SPEC.block_size
    for t in range(layout.num_blocks * bs):
        for kv, src in ((0, key), (1, value)):
            for d in range(SPEC.head_dim):
                p, off = layout.byte_offset(layer, t // bs, kv, t % bs, 0, d)
                out[p][off // 4] = src[t, 0, d]
    return out


@MUTATE
@given(setups())
def test_a_checked_object_changed_later_is_refused_or_harmless(setup):
    layout, fw, mutation, i, layer, warm = setup
    layout = Layout.preset(layout.name, SPEC, layout.num_blocks, layout.num_layers)  # own
    g = Guarded(layout, fw)
    cache = KVCache.wrap(layout, g.planes)
    backend = BACKENDS[fw]
    meta = _step(layout)
    plan = backend.plan(meta, SPEC, layout, num_q_heads=1)
    t = meta.num_tokens
    rng = np.random.default_rng(t)
    key = rng.standard_normal((t, 1, 4)).astype(np.float32)
    value = rng.standard_normal((t, 1, 4)).astype(np.float32)
    k, v = (key, value) if fw == "numpy" else (torch.from_numpy(key), torch.from_numpy(value))
    if warm:
        backend.write_kv(plan, cache, key=k, value=v, layer=layer)
        for s in g.starts:
            g.buf[s:s + layout.plane_nbytes] = 0
    cache, outcome = _mutate(g, cache, mutation, i, layer, meta)
    event(f"{fw} {mutation}: {outcome}")
    # a component layout's planes are bytes from their first element: another shape or
    # stride over the same memory changes nothing kvabi reads (harmless, checked below)
    harmless = not layout.is_axis_form and mutation in ("replace_stepping", "plane_shape")
    if mutation in ("rebind", "layout_mapping", "replace_negative", "replace_stepping",
                    "replace_shifted", "replace_other_framework", "replace_bad_key") \
            and not harmless:
        assert outcome != "applied", mutation  # refused where it was attempted
    used = "ok"
    try:
        backend.write_kv(plan, cache, key=k, value=v, layer=layer)
        cache.check_unchanged()
    except KVABIError:
        used = "refused"
    assert g.guards_intact(), f"{mutation}: bytes outside the planes' memory changed"
    if outcome == "applied" and not harmless:
        assert used == "refused", f"{mutation} went unnoticed at use"
    elif outcome in ("none", "refused") or used == "ok":
        assert used == "ok"
        want = _expected(layout, layer, key, value)
        for p, s in enumerate(g.starts):
            got = g.buf[s:s + layout.plane_nbytes].view(np.float32)
            np.testing.assert_array_equal(got, want[p])


def test_frozen_error_is_a_kvabi_error_and_an_attribute_error():
    c = KVCache.allocate(Layout.preset("flash_attn", SPEC, 2))
    with pytest.raises(FrozenError, match="^KVCache.framework"):
        c.framework = "torch"
    with pytest.raises(AttributeError):
        del c.layout
    with pytest.raises(FrozenError, match="read-only"):
        c.layout.sizes.update(B=3)
    with pytest.raises(FrozenError, match="read-only"):
        c.layout.sizes["B"] = 3
    assert c.layout.sizes["B"] == 2
