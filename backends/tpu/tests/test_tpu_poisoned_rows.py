"""NaN and inf in K/V rows a query may not see never change its output (specs/semantics.md
section 2: rows outside the window or chunk, past seq_len in the last block, in blocks the
request does not own, head-dim padding).

Every slot invisible to a chosen subset of the step's query tokens is poisoned with NaN,
+inf or -inf (K and V, every layer), the padding bytes with NaN; those tokens' outputs and
lse must equal the reference's over the clean cache.  Tokens outside the subset may see
poisoned rows, so they are not compared: this also covers keys that one row of a query
tile sees and another does not.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_tpu_jax_chunks import SPLIT
from tpu_helpers import (JAX, PALLAS, REFERENCE, TOL, batches, filled_cache, make_spec,
                         poison_invisible, rel_l2, to_backend, values, visible_slots)

import kvabi
from kvabi.util.tensors import to_jax, to_numpy


def check_poisoned(backend, spec, form, meta, group, options, seed, *, min_poisoned=1):
    rng = np.random.default_rng(seed)
    layout = kvabi.Layout.preset(form, spec, meta.num_blocks, num_layers=2)
    clean = filled_cache(layout, spec, rng)
    hq = spec.num_kv_heads * group
    query = values(rng, (meta.num_tokens, hq, spec.head_dim), spec.dtype)
    n = meta.num_actual_tokens
    checked = np.nonzero(rng.random(n) < 0.6)[0]
    if n and not len(checked):
        checked = np.array([n - 1])
    poisoned, count = poison_invisible(layout, spec, clean,
                                       visible_slots(meta, spec, checked), rng)
    assert count >= min_poisoned
    want, want_lse = REFERENCE.attention(
        REFERENCE.plan(meta, spec, layout, num_q_heads=hq, **options), clean, query=query,
        layer=1, return_lse=True)
    plan = backend.plan(meta, spec, layout, num_q_heads=hq, **options)
    out, lse = backend.attention(plan, to_backend(backend, poisoned), query=to_jax(query),
                                 layer=1, return_lse=True)
    out = np.asarray(to_numpy(out), np.float64)[checked]
    lse = np.asarray(to_numpy(lse), np.float64)[checked]
    assert np.isfinite(out).all() and np.isfinite(lse).all(), \
        f"{int((~np.isfinite(out)).any(axis=(1, 2)).sum())} of {len(checked)} tokens " \
        f"became non-finite from rows they may not see ({spec.kind})"
    assert rel_l2(out, want[checked]) <= TOL[spec.dtype]
    assert float(np.abs(lse - want_lse[checked]).max(initial=0)) <= 1e-4


def fixed_meta():
    """Decodes, a prefill spanning tiles and pages, a chunked prefill, an empty request
    and padding tokens (the batch of test_pallas_fixed_mixed_batch_every_kind: compiled
    kernels are shared)."""
    return kvabi.CommonAttentionMetadata.from_lengths(
        [1, 19, 0, 6, 1], [30, 0, 5, 11, 47], [[5, 1, 8, 0], [2, 9, 3, 3], [4, 4, 4, 4],
                                                [7, 6, 4, 4], [10, 11, 12, 13]], 16,
        num_blocks=14, num_tokens=30)


KINDS = [("full", None), ("sliding_window", 21), ("sliding_window", 3),
         ("chunked_local", 24), ("chunked_local", 8)]


@pytest.mark.parametrize("backend", [PALLAS, JAX], ids=lambda b: b.name)
@pytest.mark.parametrize("kind,span", KINDS[:2] + KINDS[3:4], ids=lambda x: str(x))
def test_poisoned_invisible_rows_fixed_batch(backend, kind, span):
    spec = make_spec(kind, 16, 1, 64, "bfloat16", span)
    check_poisoned(backend, spec, "tpu.combined", fixed_meta(), 4, {"softcap": 5.0}, 3,
                   min_poisoned=100)


@st.composite
def poison_cases(draw):
    bs = 16
    kind, span = draw(st.sampled_from(KINDS))
    spec = make_spec(kind, bs, draw(st.sampled_from((1, 2))), 64,
                     draw(st.sampled_from(("float32", "bfloat16"))), span)
    meta = draw(batches(bs, max_reqs=3, max_query=11, max_context=3))
    options = {"sinks": np.linspace(-1, 1, 2 * spec.num_kv_heads)} if draw(
        st.booleans()) else {}
    return spec, draw(st.sampled_from(("tpu.combined", "tpu.hidden"))), meta, 2, options, \
        draw(st.integers(0, 2**16))


@settings(max_examples=10, deadline=None)
@given(poison_cases())
def test_jax_poisoned_invisible_rows(case):
    check_poisoned(JAX, *case)


@settings(max_examples=6, deadline=None)
@given(poison_cases())
def test_jax_split_paths_poisoned_invisible_rows(case):
    """Small tiles and one-page chunks: poison in unmasked and masked chunk paths."""
    check_poisoned(SPLIT, *case)


def test_pallas_poisoned_window_and_chunk_cut_tiles():
    """A 12-token prefill (two 8-row tiles) with a 3-token window and an 8-token chunk:
    keys that the last row of a tile sees are invisible to its first rows."""
    meta = kvabi.CommonAttentionMetadata.from_lengths([12, 1], [9, 20], [[0, 1], [2, 3]],
                                                      16, num_blocks=5, num_tokens=14)
    for kind, span in (("sliding_window", 3), ("chunked_local", 8)):
        spec = make_spec(kind, 16, 1, 64, "float32", span)
        check_poisoned(PALLAS, spec, "tpu.hidden", meta, 2, {}, 5, min_poisoned=40)
