"""CommonAttentionMetadata against the canonical formulas, and its refusals."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvabi import CommonAttentionMetadata, KVABIError


@st.composite
def lengths(draw):
    r = draw(st.integers(0, 6))
    bs = draw(st.sampled_from([1, 2, 4, 16]))
    q = draw(st.lists(st.integers(0, 9), min_size=r, max_size=r))
    c = draw(st.lists(st.integers(0, 40), min_size=r, max_size=r))
    need = max([-(-(a + b) // bs) for a, b in zip(q, c)], default=0)
    width = need + draw(st.integers(0, 2))
    nb = max(1, r * width)
    bt = draw(st.permutations(range(nb))).copy() if nb <= 64 else list(range(nb))
    table = np.array(bt[:r * width], dtype=np.int64).reshape(r, width)
    pad = draw(st.integers(0, 3))
    return q, c, table, bs, nb, pad


@settings(max_examples=150, deadline=None)
@given(lengths())
def test_from_lengths_follows_the_canonical_formulas(case):
    q, c, table, bs, nb, pad = case
    m = CommonAttentionMetadata.from_lengths(q, c, table, bs, num_blocks=nb,
                                             num_tokens=sum(q) + pad)
    assert m.num_reqs == len(q) and m.num_tokens == sum(q) + pad
    assert m.num_actual_tokens == sum(q)
    assert m.max_query_len == max(q, default=0)
    assert m.max_seq_len == max([a + b for a, b in zip(q, c)], default=0)
    t = 0
    for r, (qr, cr) in enumerate(zip(q, c)):
        assert m.query_start_loc[r] == t and m.seq_lens[r] == qr + cr
        for i in range(qr):
            p = cr + i  # new token i of request r sits at absolute position c + i
            assert m.positions[t] == p
            assert m.slot_mapping[t] == table[r, p // bs] * bs + p % bs
            t += 1
    assert (m.slot_mapping[t:] == -1).all() and (m.positions[t:] == 0).all()
    for a in (m.query_start_loc, m.seq_lens, m.context_lens, m.block_table):
        assert a.dtype == np.int32
    assert m.slot_mapping.dtype == np.int64 and m.positions.dtype == np.int64


def _meta(**over):
    m = CommonAttentionMetadata.from_lengths([2, 1], [3, 4], [[0, 1], [2, 3]], 4, num_blocks=4)
    fields = dict(query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
                  context_lens=m.context_lens, positions=m.positions,
                  slot_mapping=m.slot_mapping, block_table=m.block_table,
                  block_size=m.block_size, num_blocks=4)
    fields.update(over)
    return CommonAttentionMetadata(**fields)


@pytest.mark.parametrize("over,match", [
    (dict(query_start_loc=[0, 2, 1]), "non-decreasing"),
    (dict(query_start_loc=[1, 2, 3]), "start at 0"),
    (dict(seq_lens=[5, 6]), "seq_lens"),
    (dict(block_table=[[0, 1], [2, 4]]), r"block_table: entry \[1, 1\] = 4"),
    (dict(block_table=[[0, -1], [2, 3]]), r"block_table: entry \[0, 1\]"),
    (dict(block_table=[[0], [2]]), "needs 2 blocks"),
    (dict(slot_mapping=[3, 4, 13]), "slot_mapping"),
    (dict(positions=[3, 5, 4]), "positions"),
])
def test_bad_metadata_is_refused(over, match):
    assert _meta().num_tokens == 3
    with pytest.raises(KVABIError, match=match):
        _meta(**over)


@pytest.mark.parametrize("args,match", [
    (([1, 2], [0], [[0], [1]], 4), "query_lens"),
    (([-1], [0], [[0]], 4), "query_lens"),
    (([1], [-2], [[0]], 4), "context_lens"),
    (([1], [0], [[0]], 0), "block_size"),
    (([1], [0], [0], 4), "block_table"),
    (([5], [0], [[0]], 4), "needs 2 blocks"),
])
def test_from_lengths_refuses_bad_input(args, match):
    with pytest.raises(KVABIError, match=match):
        CommonAttentionMetadata.from_lengths(*args)


def test_num_tokens_smaller_than_real_tokens_is_refused():
    with pytest.raises(KVABIError, match="num_tokens"):
        CommonAttentionMetadata.from_lengths([3], [0], [[0]], 4, num_tokens=2)


def test_from_lengths_keeps_its_own_block_table():
    """A block table already of the field dtype is copied, not frozen in place: the caller's
    buffer stays writable, and writing it cannot change checked metadata."""
    import torch

    bt = np.array([[0, 1], [2, 3]], np.int32)
    t = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    for table in (bt, t):
        m = CommonAttentionMetadata.from_lengths(query_lens=[1, 2], context_lens=[3, 4],
                                                 block_table=table, block_size=4)
        table[0, 0] = 7
        assert m.block_table[0, 0] == 0 and not m.block_table.flags.writeable
    assert bt.flags.writeable
