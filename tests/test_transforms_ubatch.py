"""split_ubatches: concatenated micro-batch outputs equal the whole step."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvabi import CommonAttentionMetadata, KVABIError
from kvabi.transforms import split_ubatches
from oracle_dense import (assert_unchanged, attention_data, batches, oracle, paged_attention,
                          snapshot)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.none() | st.integers(1, 6), st.none() | st.integers(1, 6))
def test_concatenation_equals_whole(data, window, chunk):
    meta = data.draw(batches())
    k, v, qry = data.draw(attention_data(meta))
    n = meta.num_tokens
    cuts = sorted(data.draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=4)))
    cuts = [c for c in cuts if 0 < c < n]
    if data.draw(st.booleans()):
        cuts = [0] + cuts + [n]  # explicit end points are accepted too
    snap = snapshot(meta)
    parts = split_ubatches(meta, cuts)
    assert_unchanged(meta, snap)
    inner = [c for c in cuts if 0 < c < n]
    edges = [0] + inner + [n]
    assert len(parts) == len(edges) - 1
    assert [p.num_tokens for p in parts] == np.diff(edges).tolist()
    # a request appears in every micro-batch its tokens touch; an empty one exactly once
    qsl = meta.query_start_loc.tolist()
    want = sum(max(1, sum(1 for a, b in zip(edges, edges[1:]) if qsl[r] < b and qsl[r + 1] > a))
               for r in range(meta.num_reqs))
    assert sum(p.num_reqs for p in parts) == want
    assert np.array_equal(np.concatenate([p.slot_mapping for p in parts]), meta.slot_mapping)
    outs, lses = [], []
    for p, a, b in zip(parts, edges, edges[1:]):
        o, l_ = paged_attention(p, k, v, qry[a:b], window=window, chunk=chunk)
        outs.append(o)
        lses.append(l_)
    want_out, want_lse = oracle(meta, k, v, qry, window=window, chunk=chunk)
    np.testing.assert_allclose(np.concatenate(outs), want_out, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(np.concatenate(lses), want_lse, rtol=1e-10, atol=1e-12)


def test_example_request_cut_in_two():
    # request 0: context 2, tokens 0..4; request 1 empty at 5; request 2: tokens 5..6
    bt = np.arange(12).reshape(3, 4)
    meta = CommonAttentionMetadata.from_lengths([5, 0, 2], [2, 1, 0], bt, 2, num_tokens=8)
    a, b = split_ubatches(meta, [3])
    assert a.query_lens.tolist() == [3] and a.context_lens.tolist() == [2]
    assert b.query_lens.tolist() == [2, 0, 2] and b.context_lens.tolist() == [5, 1, 0]
    assert b.block_table.tolist() == bt.tolist()
    assert b.num_tokens == 5 and b.slot_mapping[-1] == -1
    (whole,) = split_ubatches(meta, [])
    assert whole.query_lens.tolist() == meta.query_lens.tolist()


@pytest.mark.parametrize("cuts", [[4, 2], [2, 2], [9], [-1], [[2]], [2.5]])
def test_bad_boundaries(cuts):
    meta = CommonAttentionMetadata.from_lengths([5, 3], [0, 0], np.arange(8).reshape(2, 4), 2)
    with pytest.raises(KVABIError, match="token_boundaries"):
        split_ubatches(meta, cuts)
