"""pad: static shapes keep the real tokens' outputs and slots."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvabi import CommonAttentionMetadata, KVABIError
from kvabi.transforms import pad
from oracle_dense import (assert_unchanged, attention_data, batches, oracle, paged_attention,
                          snapshot)


@settings(max_examples=120, deadline=None)
@given(st.data(), st.none() | st.integers(1, 6))
def test_pad_keeps_real_outputs(data, window):
    meta = data.draw(batches())
    k, v, qry = data.draw(attention_data(meta))
    n = meta.num_actual_tokens
    nt = n + data.draw(st.integers(0, 6))
    nr = meta.num_reqs + data.draw(st.integers(0, 3))
    snap = snapshot(meta)
    meta2 = pad(meta, nt, nr)
    assert_unchanged(meta, snap)
    assert (meta2.num_tokens, meta2.num_reqs) == (nt, nr)
    assert meta2.block_table.shape == (nr, meta.block_table.shape[1])
    assert np.array_equal(meta2.slot_mapping[:n], meta.slot_mapping[:n])
    assert (meta2.slot_mapping[n:] == -1).all() and (meta2.positions[n:] == 0).all()
    pr = slice(meta.num_reqs, None)
    assert (meta2.query_lens[pr] == 0).all() and (meta2.context_lens[pr] == 0).all()
    assert (meta2.block_table[pr] == 0).all()
    q2 = np.concatenate([qry[:n], np.random.default_rng(0).standard_normal(
        (nt - n,) + qry.shape[1:])])
    want_out, want_lse = oracle(meta, k, v, qry, window=window)
    out, lse = paged_attention(meta2, k, v, q2, window=window)
    np.testing.assert_allclose(out[:n], want_out[:n], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse[:n], want_lse[:n], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("nt, nr, field", [(4, 2, "num_tokens"), (8, 1, "num_reqs"),
                                           (8.0, 2, "num_tokens"), (8, None, "num_reqs")])
def test_bad_sizes(nt, nr, field):
    meta = CommonAttentionMetadata.from_lengths([3, 2], [0, 1], np.arange(4).reshape(2, 2), 2)
    with pytest.raises(KVABIError, match=field):
        pad(meta, nt, nr)
