"""The kit's Hypothesis strategies draw valid, varied, readable examples; its measures are
the stated formulas."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from kvabi import KVSpec
from kvabi.util.dtypes import DTYPES, numpy_dtype
from kvabi.layout.descriptor import Layout
from kvabi.layout.presets import preset_names
from kvabi.model.spec import KINDS
from kvabi.testing import lse_error, relative_l2
from kvabi.testing.cases import exact_values, input_dtype
from kvabi.testing.strategies import (batches, kv_sharing_models, kv_specs, layouts,
                                      random_layouts)

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SHRINK = settings(max_examples=2000, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
#: reachability only: no shrinking of what was found
FIND = settings(SHRINK, phases=[Phase.generate])
SPEC = KVSpec("full", block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")


# -- specs ---------------------------------------------------------------------------------
@FAST
@given(st.data())
def test_kv_specs_respect_the_filters(data):
    kinds = data.draw(st.lists(st.sampled_from(KINDS), min_size=1, unique=True))
    dtypes = data.draw(st.lists(st.sampled_from(DTYPES), min_size=1, unique=True))
    dims = data.draw(st.lists(st.sampled_from([8, 16, 64]), min_size=1, unique=True))
    spec = data.draw(kv_specs(kinds, dtypes, dims, block_size_multiple=4))
    assert spec.kind in kinds and spec.dtype in dtypes
    assert spec.head_dim in dims and spec.head_dim_v in dims
    assert spec.block_size % 4 == 0
    if spec.is_mla:
        assert spec.num_kv_heads == 1 and spec.head_dim_v <= spec.head_dim
    else:
        assert spec.head_dim_v == spec.head_dim


@FAST
@given(kv_specs(kinds=("chunked_local",), chunk_of_blocks=True))
def test_chunks_of_whole_blocks(spec):
    assert spec.chunk % spec.block_size == 0


# -- layouts -------------------------------------------------------------------------------
def _all_offsets(layout: Layout, spec: KVSpec):
    g = np.meshgrid(*(np.arange(layout.size(a)) for a in ("L", "B", "KV", "N", "H", "D")),
                    indexing="ij")
    return layout.byte_offset(*(x.ravel() for x in g))


@FAST
@given(st.data())
def test_layouts_hold_the_spec_without_overlap(data):
    spec = data.draw(kv_specs())
    nl = data.draw(st.integers(1, 2))
    layout = data.draw(layouts(spec, num_blocks=3, num_layers=nl))
    assert layout.dtype == spec.dtype and layout.num_layers == nl
    assert (layout.size("N"), layout.size("H"), layout.size("D")) == \
        (spec.block_size, spec.num_kv_heads, spec.head_dim)
    assert layout.has_kv == (not spec.is_mla)
    plane, off = _all_offsets(layout, spec)
    # Every logical element has its own bytes, inside its plane.
    assert len(set(zip(plane.tolist(), off.tolist()))) == plane.size
    assert off.min() >= 0 and off.max() + layout.itemsize <= layout.plane_nbytes
    assert plane.max() < layout.num_planes
    assert Layout.from_json(layout.to_json()) == layout


@pytest.mark.parametrize("feature", ["planes", "extents", "strides", "plane_bytes", "folds",
                                     "packing", "kv_outermost"])
def test_random_layouts_reach_every_feature(feature):
    pred = {
        "planes": lambda l: l.planes == ("L", "KV"),
        "extents": lambda l: bool(l.extents),
        "strides": lambda l: l.strides is not None and not l.is_c_contiguous,
        "plane_bytes": lambda l: l.plane_bytes is not None,
        "folds": lambda l: bool(l.folds),
        "packing": lambda l: l.packing > 1,
        "kv_outermost": lambda l: l.order[0] == "KV",
    }[feature]
    found = find(random_layouts(SPEC, 3, 2), pred, settings=FIND)
    assert pred(found)


def test_every_preset_is_drawn():
    names = set(preset_names(SPEC))
    for name in names:
        found = find(layouts(SPEC, 2, random=False), lambda l, n=name: l.name == n,
                     settings=FIND)
        assert found.name == name


# -- batches -------------------------------------------------------------------------------
@FAST
@given(st.data())
def test_batches_are_consistent(data):
    spec = data.draw(kv_specs())
    meta = data.draw(batches(spec))
    q, c = meta.query_lens, meta.context_lens
    assert 1 <= meta.num_reqs <= 4 and meta.num_actual_tokens >= 1
    assert meta.num_tokens - meta.num_actual_tokens <= 3
    assert meta.block_size == spec.block_size and meta.num_blocks >= 1
    need = -(-meta.seq_lens // spec.block_size)
    used = [meta.block_table[r, :need[r]] for r in range(meta.num_reqs)]
    assert all(((u >= 0) & (u < meta.num_blocks)).all() for u in used)
    # Blocks are private except a common prefix of the requests with query tokens.
    active = [r for r in range(meta.num_reqs) if q[r] > 0]
    shared = 0
    if len(active) > 1:
        rows = [used[r] for r in active]
        while all(len(x) > shared for x in rows) and len({x[shared] for x in rows}) == 1:
            shared += 1
    ids = np.concatenate([used[r][shared if r in active else 0:] for r in range(meta.num_reqs)]
                         + [used[active[0]][:shared]])
    assert len(np.unique(ids)) == len(ids)
    assert (c[q == 0] == 0).all()


def test_batches_mix_every_kind_of_request():
    def mixed(m):
        q, c = m.query_lens, m.context_lens
        return ((q == 1) & (c > 0)).any() and ((q > 1) & (c > 0)).any() and \
            ((q > 0) & (c == 0)).any() and (q == 0).any() and m.num_tokens > q.sum()

    assert mixed(find(batches(SPEC, shared_prefix=False), mixed, settings=FIND))


@FAST
@given(batches(SPEC, shared_prefix=True))
def test_forced_shared_prefix(meta):
    active = meta.query_lens > 0
    rows = meta.block_table[active]
    assert (rows[:, 0] == rows[0, 0]).all()
    assert (meta.context_lens[active] >= SPEC.block_size).all()


def test_shrinks_to_a_readable_minimum():
    meta = find(batches(SPEC), lambda m: m.num_reqs >= 2, settings=SHRINK)
    assert meta.query_lens.tolist() == [1, 1] and meta.context_lens.tolist() == [1, 1]
    assert meta.block_table.tolist() == [[0], [1]]  # block ids in order, no spare columns
    assert meta.num_tokens == 2 and meta.num_blocks == 2


# -- KV sharing models ---------------------------------------------------------------------
@FAST
@given(kv_sharing_models(SPEC, min_shared=2))
def test_kv_sharing_models(model):
    shared = model.shared_layers
    assert len(shared) >= 2 and model.layers[0].shares is None
    names = [l.name for l in model.layers]
    for l in model.layers:
        assert l.spec == SPEC
        if l.shares is not None:
            assert names.index(l.shares) < names.index(l.name)
            assert model.layer(model.owner(l.name)).shares is None


# -- values and measures -------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_are_exact_in_the_cache_dtype(dtype):
    x = exact_values(np.random.default_rng(0), (64,), dtype)
    via_cache = x.astype(numpy_dtype(dtype)).astype(np.float64)
    via_input = x.astype(input_dtype(dtype)).astype(np.float64)
    np.testing.assert_array_equal(via_cache, x)
    np.testing.assert_array_equal(via_input, x)
    assert np.unique(x).size > 4


def test_relative_l2_and_lse_error_formulas():
    want = np.array([[3.0, 4.0], [0.0, 0.0]])
    got = want + np.array([[0.0, 0.5], [0.0, 0.0]])
    assert relative_l2(got, want) == pytest.approx(0.5 / 5.0)
    assert relative_l2(np.array([np.nan, 1.0]), np.array([1.0, 1.0])) == np.inf
    assert lse_error(np.array([-np.inf, 1.0]), np.array([-np.inf, 1.25])) == 0.25
    assert lse_error(np.array([-np.inf]), np.array([0.0])) == np.inf
