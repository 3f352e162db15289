"""write_kv of both TPU backends leaves the cache byte-identical to the reference's.

The cache starts poisoned (every byte, head-dim padding included) and then filled, so a
write to a wrong slot, to a padding token's slot (-1), to another layer or into padding
bytes shows up as a byte difference.  Examples are few and small: tpu.pallas runs in Pallas
TPU interpret mode here.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpu_helpers import (JAX, PALLAS, REFERENCE, batches, cross_layer_layout, filled_cache,
                         make_spec, same_bytes, to_backend, values)

import kvabi
from kvabi.util.tensors import to_jax, to_numpy

FORMS = ("tpu.combined", "tpu.hidden", "tpu.combined.cross_layer", "tpu.hidden.cross_layer")


def build_layout(form, spec, num_blocks):
    if form.endswith(".cross_layer"):
        return cross_layer_layout(spec, num_blocks, 2, form.rsplit(".", 1)[0])
    return kvabi.Layout.preset(form, spec, num_blocks, num_layers=2)


def check_write(backend, spec, form, meta, layer, seed):
    """The write equals the reference's byte for byte; the cache argument's planes of the
    layer are consumed (donated) and the others passed through into the KVCache that comes
    back."""
    rng = np.random.default_rng(seed)
    layout = build_layout(form, spec, meta.num_blocks)
    want = filled_cache(layout, spec, rng)
    cache = to_backend(backend, want)
    t, h, d = meta.num_tokens, spec.num_kv_heads, spec.head_dim
    key, value = values(rng, (t, h, d), spec.dtype), values(rng, (t, h, d), spec.dtype)
    hq = spec.num_kv_heads
    REFERENCE.write_kv(REFERENCE.plan(meta, spec, layout, num_q_heads=hq), want, key=key,
                       value=value, layer=layer)
    got = backend.write_kv(backend.plan(meta, spec, layout, num_q_heads=hq), cache,
                           key=to_jax(key), value=to_jax(value), layer=layer)
    assert type(got) is kvabi.KVCache
    assert len(got) == layout.num_planes
    for i, (g, w) in enumerate(zip(got, want)):
        g = to_numpy(g)
        assert same_bytes(g, np.ascontiguousarray(w)), \
            f"plane {i}: {int((g != w).sum())} elements differ from the reference"
    mine = {layout.plane_index(layer, kv) for kv in range(2)} if meta.num_tokens else set()
    for i, (old, new) in enumerate(zip(cache, got)):
        if i in mine:  # donated: consumed, and the result is a new array
            assert old.is_deleted() and new is not old, f"plane {i} not donated"
        else:
            assert new is old, f"plane {i} of another layer was replaced"


@st.composite
def write_cases(draw, block_sizes):
    dtype = draw(st.sampled_from(("float32", "bfloat16")))
    bs = draw(st.sampled_from(block_sizes))
    spec = make_spec("full", bs, draw(st.sampled_from((1, 2, 3))),
                     draw(st.sampled_from((64, 128))), dtype)
    meta = draw(batches(bs, max_query=bs + 3, max_context=1))
    return spec, draw(st.sampled_from(FORMS)), meta, draw(st.integers(0, 1)), \
        draw(st.integers(0, 2**16))


@settings(max_examples=5, deadline=None)
@given(write_cases((16, 32, 64)))
def test_pallas_write_equals_reference(case):
    check_write(PALLAS, *case)


@settings(max_examples=12, deadline=None)
@given(write_cases((16, 32, 64)))
def test_jax_write_equals_reference(case):
    check_write(JAX, *case)


@pytest.mark.parametrize("backend", [PALLAS, JAX], ids=lambda b: b.name)
def test_write_spanning_pages_and_padding_tokens(backend):
    """One fixed batch through both paths: a prefill crossing three pages, a decode, an
    empty request and padding tokens whose rows must not land anywhere."""
    spec = make_spec("full", 16, 2, 64, "bfloat16")
    meta = kvabi.CommonAttentionMetadata.from_lengths(
        [37, 1, 0], [5, 20, 3], [[4, 0, 7], [2, 5, 1], [3, 6, 6]], 16, num_blocks=8,
        num_tokens=41)
    for form in ("tpu.combined", "tpu.hidden"):
        check_write(backend, spec, form, meta, 1, 0)


@pytest.mark.parametrize("backend", [PALLAS, JAX], ids=lambda b: b.name)
def test_shared_layer_never_writes(backend):
    """A KV-sharing layer only reads: attention over the owner's cache leaves it intact."""
    spec = make_spec("full", 16, 1, 64, "float32")
    meta = kvabi.CommonAttentionMetadata.from_lengths([3, 1], [0, 17], [[1, 2], [0, 3]], 16,
                                                      num_blocks=4)
    layout = kvabi.Layout.preset("tpu.combined", spec, 4, num_layers=1)
    rng = np.random.default_rng(1)
    cache = to_backend(backend, filled_cache(layout, spec, rng))
    before = [np.array(to_numpy(p)) for p in cache]
    q = to_jax(values(rng, (4, 2, 64), "float32"))
    backend.attention(backend.plan(meta, spec, layout, num_q_heads=2), cache, query=q)
    for b, p in zip(before, cache):
        assert same_bytes(b, to_numpy(p))
