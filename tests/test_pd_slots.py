"""P/D's step arithmetic against direct formulas: token slots of a block list (null
blocks left out), slot pairs across block sizes, the restorable prefix of a host tier with
sliding-window groups."""
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvabi.pd.slots import NULL as NULL_BLOCK
from kvabi.pd.slots import (block_pairs, null_allowed, paired_slots, token_slots,
                             usable_prefix)

block_lists = st.lists(st.one_of(st.just(NULL_BLOCK), st.integers(0, 50)), max_size=8)


def slot_of(blocks, bs, p):
    """The semantics' slot formula, one position at a time."""
    i = p // bs
    if i >= len(blocks) or blocks[i] == NULL_BLOCK:
        return -1
    return blocks[i] * bs + p % bs


@given(block_lists, st.sampled_from([1, 4, 32]), st.integers(0, 40), st.integers(0, 60))
def test_token_slots_follow_the_formula(blocks, bs, start, n):
    got = token_slots(blocks, bs, start, n)
    assert got.tolist() == [slot_of(blocks, bs, p) for p in range(start, start + n)]


@given(block_lists, block_lists, st.sampled_from([(32, 64), (64, 32), (16, 16)]),
       st.integers(0, 70), st.integers(0, 90))
def test_paired_slots_keep_tokens_both_sides_hold(src, dst, sizes, start, n):
    sb, db = sizes
    s, d = paired_slots(src, sb, dst, db, start, n)
    want = [(slot_of(src, sb, p), slot_of(dst, db, p)) for p in range(start, start + n)]
    want = [(a, b) for a, b in want if a >= 0 and b >= 0]
    assert list(zip(s.tolist(), d.tolist())) == want


@given(st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=3),
       st.data())
def test_usable_prefix_is_the_longest_restorable(present, data):
    need = [data.draw(st.sampled_from([1, 2, 3, 1 << 40])) for _ in present]
    got = usable_prefix(np.array(present), need)

    def ok(k):
        return all(all(row[i] for i in range(max(k - nb, 0), k))
                   for row, nb in zip(present, need))

    assert got == max(k for k in range(7) if k == 0 or ok(k))


def test_block_pairs_move_the_blocks_holding_the_range():
    s, d = block_pairs([5, 6, 7, 8], [9, NULL_BLOCK, 11, 12], 32, 32, 70)
    # positions 32..101 lie in blocks 1..3; block 1 is null on the destination
    assert s.tolist() == [7, 8] and d.tolist() == [11, 12]


def test_matching_parts_prefers_the_same_block_image_and_refuses_other_parts():
    import pytest

    from kvabi import KVABIError
    from kvabi.pd.parts import matching_parts

    mine = [("k", "K"), ("v", "V"), ("image.kt_v.n32.d32", "I")]
    assert matching_parts(mine, {"k": "a", "v": "b", "image.kt_v.n32.d32": "c"}, 0) == \
        [("image.kt_v.n32.d32", "I", "c")]
    assert matching_parts(mine, {"k": "a", "v": "b", "image.kt_v.n64.d32": "c"}, 0) == \
        [("k", "K", "a"), ("v", "V", "b")]
    with pytest.raises(KVABIError, match=r"kvabi_handshakes\[0\]: the peer serves parts \['kv'\]"):
        matching_parts(mine, {"kv": "a"}, 0)
    both = [("kv", "KV"), ("k", "K"), ("v", "V")]
    assert matching_parts(both, {"kv": "a", "k": "b", "v": "c"}, 0) == [("kv", "KV", "a")]
    assert matching_parts(both, {"k": "b", "v": "c"}, 0) == [("k", "K", "b"), ("v", "V", "c")]
    with pytest.raises(KVABIError, match=r"kvabi_handshakes\[2\]: must be an object"):
        matching_parts(mine, ["k"], 2)
