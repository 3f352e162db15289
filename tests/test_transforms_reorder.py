"""reorder_decode_first / split_decode_prefill / permute_requests."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvabi import CommonAttentionMetadata, KVABIError
from kvabi.transforms import permute_requests, reorder_decode_first, split_decode_prefill
from oracle_dense import (assert_unchanged, attention_data, batches, oracle, paged_attention,
                          snapshot)

SET = settings(max_examples=120, deadline=None)


@SET
@given(st.data(), st.integers(0, 3))
def test_decode_first_then_split(data, thr):
    meta = data.draw(batches(max_reqs=7, max_query=5))
    snap = snapshot(meta)
    perm = reorder_decode_first(meta, thr)
    ql = meta.query_lens.tolist()
    want = sorted(range(meta.num_reqs), key=lambda r: (ql[r] > thr, r))  # stable
    assert perm.tolist() == want
    meta2, tperm = permute_requests(meta, perm)
    assert_unchanged(meta, snap)
    nd, np_, ndt, npt = split_decode_prefill(meta2, thr)
    assert nd == sum(q <= thr for q in ql) and np_ == meta.num_reqs - nd
    assert ndt == sum(q for q in ql if q <= thr)
    assert npt == sum(q for q in ql if q > thr)
    assert np.array_equal(meta2.query_lens, np.array(ql, int)[perm])


@SET
@given(st.data(), st.none() | st.integers(1, 6))
def test_permute_attention(data, window):
    meta = data.draw(batches(max_reqs=6))
    k, v, qry = data.draw(attention_data(meta))
    perm = np.array(data.draw(st.permutations(range(meta.num_reqs))), np.int64)
    meta2, tperm = permute_requests(meta, perm)
    assert sorted(tperm.tolist()) == list(range(meta.num_tokens))
    assert np.array_equal(meta2.slot_mapping, meta.slot_mapping[tperm])
    want_out, want_lse = oracle(meta, k, v, qry, window=window)
    out, lse = paged_attention(meta2, k, v, qry[tperm], window=window)
    n = meta.num_actual_tokens
    np.testing.assert_allclose(out[:n], want_out[tperm][:n], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse[:n], want_lse[tperm][:n], rtol=1e-10, atol=1e-12)


def _meta():
    return CommonAttentionMetadata.from_lengths([3, 1, 1], [0, 2, 5], np.arange(9).reshape(3, 3),
                                                2, num_tokens=7)


def test_example():
    meta = _meta()
    perm = reorder_decode_first(meta)
    assert perm.tolist() == [1, 2, 0]
    meta2, tperm = permute_requests(meta, perm)
    assert tperm.tolist() == [3, 4, 0, 1, 2, 5, 6]
    assert split_decode_prefill(meta2) == (2, 1, 2, 3)


def test_stable_on_a_large_batch():
    # numpy sorts short arrays stably even unasked; a large batch checks stability for real
    q = np.random.default_rng(5).integers(0, 4, 300)
    meta = CommonAttentionMetadata.from_lengths(q, np.zeros(300, int), np.zeros((300, 4), int),
                                                1)
    want = sorted(range(300), key=lambda r: (q[r] > 1, r))
    assert reorder_decode_first(meta).tolist() == want


def test_not_decode_first():
    with pytest.raises(KVABIError, match="decode-first"):
        split_decode_prefill(_meta())


@pytest.mark.parametrize("perm", [[0, 1], [0, 1, 1], [0, 1, 3], [-1, 0, 1], [[0, 1, 2]],
                                  [0.0, 1.0, 2.0]])
def test_bad_perm(perm):
    with pytest.raises(KVABIError, match="perm"):
        permute_requests(_meta(), perm)


@pytest.mark.parametrize("thr", [-1, 1.5, None])
def test_bad_threshold(thr):
    with pytest.raises(KVABIError, match="decode_threshold"):
        reorder_decode_first(_meta(), thr)
