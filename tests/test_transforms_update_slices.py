"""kv_update_slices: applying the slices writes exactly what scattering by slot does."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvabi import CommonAttentionMetadata, KVABIError
from kvabi.transforms import kv_update_slices
from oracle_dense import assert_unchanged, batches, snapshot


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 8))
def test_slices_write_the_slot_mapping(data, per):
    meta = data.draw(batches(block_sizes=(1, 2, 4, 8), max_query=20))
    snap = snapshot(meta)
    slices, n = kv_update_slices(meta, per)
    assert_unchanged(meta, snap)
    assert slices.dtype == np.int32 and slices.shape[0] == 3
    assert slices.shape[1] % per == 0 and slices.shape[1] >= max(n, 1)
    assert (slices[:, n:] == 0).all()
    bs = meta.block_size
    start, src, length = slices[:, :n].astype(np.int64)
    assert (length > 0).all()
    assert ((start % bs) + length <= bs).all()  # never crosses a page
    # one slice per (request, page touched by its new tokens)
    pages = {(int(r), int(p) // bs) for r, p in zip(meta.token_request,
                                                    meta.positions[:meta.num_actual_tokens])}
    assert n == len(pages)
    slots = (meta.num_blocks or 1) * bs
    new_kv = np.arange(1, meta.num_tokens + 1) * 10
    want = np.zeros(slots, np.int64)
    real = meta.slot_mapping >= 0
    want[meta.slot_mapping[real]] = new_kv[real]
    got = np.zeros(slots, np.int64)
    for a, b, ln in zip(start, src, length):
        got[a:a + ln] = new_kv[b:b + ln]
    assert np.array_equal(got, want)


def test_example():
    # block 4; request 0: context 2 + 5 new (positions 2..6 over pages 0,1); request 1: 1 new
    meta = CommonAttentionMetadata.from_lengths([5, 1], [2, 0], [[3, 9], [5, 0]], 4)
    slices, n = kv_update_slices(meta, 4)
    assert n == 3
    assert slices.tolist() == [[14, 36, 20, 0], [0, 2, 5, 0], [2, 3, 1, 0]]


@pytest.mark.parametrize("per", [0, -3, 2.0])
def test_bad_slices_per_block(per):
    meta = CommonAttentionMetadata.from_lengths([1], [0], [[0]], 4)
    with pytest.raises(KVABIError, match="num_slices_per_block"):
        kv_update_slices(meta, per)
