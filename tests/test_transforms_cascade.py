"""cascade_split: merging the shared-prefix part and the suffix part equals the whole."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvabi import CommonAttentionMetadata, KVABIError
from kvabi.step.merge import merge_attention
from kvabi.transforms import cascade_split
from oracle_dense import (assert_unchanged, attention_data, batches, oracle, paged_attention,
                          snapshot)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(0, 4), st.none() | st.floats(1.0, 30.0))
def test_merge_of_parts_equals_whole(data, shared, softcap):
    meta = data.draw(batches(shared_prefix_blocks=shared, max_context=24,
                             min_context=data.draw(st.integers(0, 12))))
    k, v, qry = data.draw(attention_data(meta))
    cpb = data.draw(st.integers(0, shared))
    snap = snapshot(meta)
    prefix_len, pre, suf = cascade_split(meta, cpb)
    assert_unchanged(meta, snap)
    bs = meta.block_size
    active = [r for r in range(meta.num_reqs) if meta.query_lens[r] > 0]
    cap = min([cpb * bs] + [int(meta.context_lens[r]) for r in active]) if active else 0
    assert prefix_len == cap // bs * bs
    assert np.array_equal(suf.slot_mapping, meta.slot_mapping)
    want_out, want_lse = oracle(meta, k, v, qry, softcap=softcap)
    s_out, s_lse = paged_attention(suf, k, v, qry, softcap=softcap)
    n = meta.num_actual_tokens
    if prefix_len == 0:
        assert pre is None
        out, lse = s_out, s_lse
    else:
        assert pre.num_tokens == meta.num_tokens and pre.num_reqs == n
        p_out, p_lse = paged_attention(pre, k, v, qry, softcap=softcap)
        out, lse = merge_attention(p_out, p_lse, s_out, s_lse)
    np.testing.assert_allclose(out[:n], want_out[:n], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse[:n], want_lse[:n], rtol=1e-10, atol=1e-12)


def _meta(bt):
    return CommonAttentionMetadata.from_lengths([2, 1, 0], [9, 5, 0], bt, 2)


def test_example():
    bt = np.array([[7, 8, 9, 1, 2, 3], [7, 8, 9, 4, 0, 0], [5, 5, 5, 5, 5, 5]])
    prefix_len, pre, suf = cascade_split(_meta(bt), 3)
    assert prefix_len == 4  # capped by context 5, rounded down to whole blocks
    assert pre.num_reqs == 3 and pre.positions.tolist() == [3, 3, 3]
    assert pre.block_table.tolist() == [[7, 8]] * 3
    assert suf.context_lens.tolist() == [5, 1, 0]
    assert suf.block_table.tolist() == [[9, 1, 2, 3], [9, 4, 0, 0], [5, 5, 5, 5]]
    assert suf.positions.tolist() == [5, 6, 1]


def test_prefix_not_shared():
    bt = np.array([[7, 8, 9, 1, 2, 3], [7, 6, 9, 4, 0, 0], [5, 5, 5, 5, 5, 5]])
    with pytest.raises(KVABIError, match="block_table: .*request 1.*column 1"):
        cascade_split(_meta(bt), 2)


@pytest.mark.parametrize("cpb", [-1, 7, 1.0])
def test_bad_prefix_blocks(cpb):
    bt = np.array([[7, 8, 9, 1, 2, 3], [7, 8, 9, 4, 0, 0], [5, 5, 5, 5, 5, 5]])
    with pytest.raises(KVABIError, match="common_prefix_blocks"):
        cascade_split(_meta(bt), cpb)
