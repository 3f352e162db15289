"""Every transform builds its output without re-validating it (a trusted constructor); these
properties prove each output would pass ``validate()``, the independent check a hand-built
CommonAttentionMetadata goes through, on random batches and random transform arguments."""
import numpy as np
from hypothesis import given, settings, strategies as st

from kvabi import CommonAttentionMetadata
from kvabi import transforms as T
from oracle_dense import assert_unchanged, batches, snapshot

FIELDS = ("query_start_loc", "seq_lens", "context_lens", "positions", "slot_mapping",
          "block_table", "block_size", "num_blocks")


def assert_valid(meta):
    """``meta`` passes validate(), and so does a hand-built copy of its fields (coerced
    from scratch by the public constructor)."""
    assert isinstance(meta, CommonAttentionMetadata)
    meta.validate()
    copy = CommonAttentionMetadata(**{f: getattr(meta, f) for f in FIELDS})
    for f in FIELDS[:6]:
        assert np.array_equal(getattr(copy, f), getattr(meta, f)), f


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_prefill_skip_outputs_are_valid(data):
    meta = data.draw(batches())
    snap = snapshot(meta)
    assert_valid(T.prefill_skip(meta)[0])
    # keep the last k tokens of a random subset of requests
    q = meta.query_lens
    keep = []
    for r in range(meta.num_reqs):
        k = data.draw(st.integers(0, int(q[r])))
        end = int(meta.query_start_loc[r + 1])
        keep.extend(range(end - k, end))
    assert_valid(T.prefill_skip(meta, keep)[0])
    assert_unchanged(meta, snap)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_local_virtual_batches_outputs_are_valid(data):
    meta = data.draw(batches(max_context=40))
    snap = snapshot(meta)
    chunk = meta.block_size * data.draw(st.integers(1, 6))
    meta2, vreq = T.local_virtual_batches(meta, chunk)
    assert_valid(meta2)
    assert vreq.dtype == np.int64 and len(vreq) == meta2.num_reqs
    assert_unchanged(meta, snap)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_reorder_and_permute_outputs_are_valid(data):
    meta = data.draw(batches())
    snap = snapshot(meta)
    perm = data.draw(st.permutations(range(meta.num_reqs)))
    assert_valid(T.permute_requests(meta, perm)[0])
    t = data.draw(st.integers(0, 3))
    ordered, _ = T.permute_requests(meta, T.reorder_decode_first(meta, t))
    assert_valid(ordered)
    T.split_decode_prefill(ordered, t)
    assert_unchanged(meta, snap)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_split_ubatches_outputs_are_valid(data):
    meta = data.draw(batches(min_reqs=1))
    snap = snapshot(meta)
    n = meta.num_tokens
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, n - 1)), max_size=3))) if n > 1 \
        else []
    parts = T.split_ubatches(meta, cuts)
    for part in parts:
        assert_valid(part)
    assert sum(p.num_tokens for p in parts) == n
    assert_unchanged(meta, snap)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(0, 4))
def test_cascade_split_outputs_are_valid(data, shared):
    meta = data.draw(batches(shared_prefix_blocks=shared, max_context=24,
                             min_context=data.draw(st.integers(0, 12))))
    snap = snapshot(meta)
    prefix_len, pre, suf = T.cascade_split(meta, data.draw(st.integers(0, shared)))
    assert_valid(suf)
    if pre is not None:
        assert_valid(pre)
    assert_unchanged(meta, snap)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_pad_outputs_are_valid(data):
    meta = data.draw(batches())
    snap = snapshot(meta)
    nt = data.draw(st.integers(meta.num_actual_tokens, meta.num_actual_tokens + 5))
    nr = data.draw(st.integers(meta.num_reqs, meta.num_reqs + 3))
    assert_valid(T.pad(meta, nt, nr))
    assert_unchanged(meta, snap)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_chained_transforms_stay_valid(data):
    """Outputs are inputs of further transforms (as engines chain them): still valid."""
    meta = data.draw(batches(min_reqs=1, max_context=30))
    m, _ = T.permute_requests(meta, T.reorder_decode_first(meta))
    m = T.pad(m, m.num_tokens + 2, m.num_reqs + 1)
    m, _ = T.local_virtual_batches(m, m.block_size * 2)
    assert_valid(m)
    m, _ = T.prefill_skip(m)
    assert_valid(m)
    for part in T.split_ubatches(m, [m.num_tokens // 2] if m.num_tokens > 1 else []):
        assert_valid(part)
