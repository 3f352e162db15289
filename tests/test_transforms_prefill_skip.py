"""prefill_skip: the kept tokens' outputs equal the full computation's at token_index."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvabi import CommonAttentionMetadata, KVABIError
from kvabi.transforms import prefill_skip
from oracle_dense import (assert_unchanged, attention_data, batches, oracle, paged_attention,
                          snapshot)

SET = settings(max_examples=120, deadline=None)
masks = st.fixed_dictionaries({"window": st.none() | st.integers(1, 8),
                               "chunk": st.none() | st.integers(1, 8)})


def _close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@SET
@given(st.data(), masks)
def test_default_keeps_last_token_and_matches_full(data, kw):
    meta = data.draw(batches())
    k, v, qry = data.draw(attention_data(meta))
    snap = snapshot(meta)
    meta2, idx = prefill_skip(meta)
    assert_unchanged(meta, snap)
    qsl = meta.query_start_loc
    want = [qsl[r + 1] - 1 for r in range(meta.num_reqs) if qsl[r + 1] > qsl[r]]
    assert idx.dtype == np.int64 and idx.tolist() == want
    assert np.array_equal(meta2.seq_lens, meta.seq_lens)
    assert np.array_equal(meta2.block_table, meta.block_table)
    full_out, full_lse = oracle(meta, k, v, qry, **kw)
    out, lse = paged_attention(meta2, k, v, qry[idx], **kw)
    _close(out, full_out[idx])
    _close(lse, full_lse[idx])


@SET
@given(st.data(), masks)
def test_keep_suffix_runs(data, kw):
    meta = data.draw(batches())
    k, v, qry = data.draw(attention_data(meta))
    keep = []
    for r in range(meta.num_reqs):  # the last k_r tokens of each request (spec decode)
        a, b = int(meta.query_start_loc[r]), int(meta.query_start_loc[r + 1])
        kr = data.draw(st.integers(0, b - a))
        keep += list(range(b - kr, b))
    snap = snapshot(meta)
    meta2, idx = prefill_skip(meta, keep=np.array(keep, np.int32))
    assert_unchanged(meta, snap)
    assert idx.tolist() == keep
    assert np.array_equal(meta2.positions, meta.positions[keep])
    assert np.array_equal(meta2.slot_mapping, meta.slot_mapping[keep])
    full_out, full_lse = oracle(meta, k, v, qry, **kw)
    out, lse = paged_attention(meta2, k, v, qry[idx], **kw)
    _close(out, full_out[idx])
    _close(lse, full_lse[idx])


def test_pure_decodes_are_unchanged():
    bt = np.arange(12).reshape(3, 4)
    meta = CommonAttentionMetadata.from_lengths([1, 1, 1], [3, 0, 6], bt, 2)
    meta2, idx = prefill_skip(meta)
    assert idx.tolist() == [0, 1, 2]
    for f in ("query_start_loc", "seq_lens", "context_lens", "positions", "slot_mapping",
              "block_table"):
        assert np.array_equal(getattr(meta2, f), getattr(meta, f)), f
    meta2.validate()


def _meta():
    # request 0: tokens 0..3, request 1: tokens 4..5
    return CommonAttentionMetadata.from_lengths([4, 2], [1, 0], np.arange(6).reshape(2, 3), 2)


@pytest.mark.parametrize("keep, field", [
    ([1, 3], "keep"),        # not a contiguous run ending at the last token
    ([2], "keep"),           # does not end at the request's last token
    ([3, 2], "keep"),        # unsorted
    ([3, 3], "keep"),        # repeated
    ([6], "keep"),           # out of range
    ([-1], "keep"),
    ([[3]], "keep"),         # not 1-D
    ([3.0], "keep"),         # not integers
])
def test_bad_keep(keep, field):
    with pytest.raises(KVABIError, match=field):
        prefill_skip(_meta(), keep=keep)


def test_meta_type_checked():
    with pytest.raises(KVABIError, match="meta"):
        prefill_skip({"query_start_loc": [0]})


def test_keep_last_two_of_prefill():
    meta2, idx = prefill_skip(_meta(), keep=[2, 3, 5])
    assert idx.tolist() == [2, 3, 5]
    # request 0 (seq 5) keeps 2 tokens: context 3; request 1 (seq 2) keeps 1: context 1
    assert meta2.context_lens.tolist() == [3, 1]
    assert meta2.positions.tolist() == [3, 4, 1]
