"""local_virtual_batches: causal attention over virtual requests == chunked local attention."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvabi import CommonAttentionMetadata, KVABIError
from kvabi.transforms import local_virtual_batches
from oracle_dense import (assert_unchanged, attention_data, batches, oracle, paged_attention,
                          snapshot)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 4), st.none() | st.floats(1.0, 30.0))
def test_causal_over_virtual_equals_chunked_local(data, chunk_blocks, softcap):
    meta = data.draw(batches(max_context=20))
    chunk = chunk_blocks * meta.block_size
    k, v, qry = data.draw(attention_data(meta))
    snap = snapshot(meta)
    meta2, vreq = local_virtual_batches(meta, chunk)
    assert_unchanged(meta, snap)
    # tokens keep their order and slots; padding stays padding
    assert meta2.num_tokens == meta.num_tokens
    assert meta2.num_actual_tokens == meta.num_actual_tokens
    assert np.array_equal(meta2.slot_mapping, meta.slot_mapping)
    # one virtual request per (request, chunk touched by its queries), in order
    want = []
    for r in range(meta.num_reqs):
        a, b = meta.query_start_loc[r], meta.query_start_loc[r + 1]
        want += [r] * len(set((meta.positions[a:b] // chunk).tolist()))
    assert vreq.tolist() == want
    assert (meta2.seq_lens <= chunk).all()
    want_out, want_lse = oracle(meta, k, v, qry, chunk=chunk, softcap=softcap)
    out, lse = paged_attention(meta2, k, v, qry, softcap=softcap)
    n = meta.num_actual_tokens
    np.testing.assert_allclose(out[:n], want_out[:n], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse[:n], want_lse[:n], rtol=1e-10, atol=1e-12)


def test_example():
    # block 2, chunk 4: context 3 + 6 queries -> positions 3..8 span chunks 0, 1, 2
    bt = np.array([[10, 11, 12, 13, 14]])
    meta = CommonAttentionMetadata.from_lengths([6], [3], bt, 2)
    meta2, vreq = local_virtual_batches(meta, 4)
    assert vreq.tolist() == [0, 0, 0]
    assert meta2.query_lens.tolist() == [1, 4, 1]
    assert meta2.context_lens.tolist() == [3, 0, 0]
    assert meta2.block_table.tolist() == [[10, 11], [12, 13], [14, 0]]
    assert meta2.positions.tolist() == [3, 0, 1, 2, 3, 0]


@pytest.mark.parametrize("chunk", [3, 0, -2, 2.0, True])
def test_bad_chunk(chunk):
    meta = CommonAttentionMetadata.from_lengths([2], [0], [[0]], 2)
    with pytest.raises(KVABIError, match="chunk"):
        local_virtual_batches(meta, chunk)
