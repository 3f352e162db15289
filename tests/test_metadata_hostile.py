"""Hostile metadata (issue 10): every bad input is a KVABIError naming the field, never a
crash deep in numpy, a wrapped integer or a silent truncation; values at the int32/int64
edges are either served exactly or refused."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvabi import CommonAttentionMetadata, KVABIError
from kvabi import transforms as T
from kvabi.testing.profiles import current_profile

#: junk examples per fuzz test: a few hundred in ci, 10,000 in the thorough profile
FUZZ = 10_000 if current_profile() == "thorough" else 300

I32 = 2**31 - 1
FL = CommonAttentionMetadata.from_lengths


def _fields(**over):
    m = FL([2, 1], [3, 4], [[0, 1], [2, 3]], 4, num_blocks=4)
    f = dict(query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
             context_lens=m.context_lens, positions=m.positions, slot_mapping=m.slot_mapping,
             block_table=m.block_table, block_size=4, num_blocks=4)
    f.update(over)
    return f


# -- from_lengths ------------------------------------------------------------------------
@pytest.mark.parametrize("args,kw,field", [
    (([1.0], [0], [[0]], 4), {}, "query_lens"),
    (([1], [0.0], [[0]], 4), {}, "context_lens"),
    (([True], [0], [[0]], 4), {}, "query_lens"),
    (([1], [0], [[1.7]], 4), {}, "block_table"),
    (([1], [0], [[0], [1, 2]], 4), {}, "block_table"),          # ragged
    (([1], [0], [["0"]], 4), {}, "block_table"),
    (([1], [0], None, 4), {}, "block_table"),
    ((None, [0], [[0]], 4), {}, "query_lens"),
    ((["1"], [0], [[0]], 4), {}, "query_lens"),
    (([1 + 0j], [0], [[0]], 4), {}, "query_lens"),
    (([[1]], [0], [[0]], 4), {}, "query_lens"),
    (([1], [0], [[0]], 4.0), {}, "block_size"),
    (([1], [0], [[0]], True), {}, "block_size"),
    (([1], [0], [[0]], 0), {}, "block_size"),
    (([1], [0], [[0]], 4), dict(num_blocks=-5), "num_blocks"),
    (([1], [0], [[0]], 4), dict(num_blocks=2.0), "num_blocks"),
    (([1], [0], [[0]], 4), dict(num_tokens=4.7), "num_tokens"),
    (([1], [0], [[0]], 4), dict(num_tokens=2**40), "num_tokens"),
    (([1], [2**32], [[0]], 4), {}, "context_lens"),
    (([1], [2**70], [[0]], 4), {}, "context_lens"),
    (([2**32], [0], [[0]], 4), {}, "query_lens"),
    (([1], [0], [[2**31]], 4), {}, "block_table"),
    (([1], [0], [[1]], 4), dict(num_blocks=1), "block_table"),
])
def test_from_lengths_refuses_naming_the_field(args, kw, field):
    with pytest.raises(KVABIError, match=rf"^{field}\b"):
        FL(*args, **kw)


def test_seq_len_beyond_int32_is_refused_not_wrapped():
    # 2**31 - 1 cached tokens plus one new: seq_len 2**31 would wrap to -2**31 in int32.
    with pytest.raises(KVABIError, match=r"context_lens/query_lens: request 0 has seq_len"):
        FL([1], [I32], [[0]], 2**31)
    # at the edge exactly it is served
    m = FL([1], [I32 - 1], [[0]], 2**31)
    assert int(m.seq_lens[0]) == I32 and int(m.positions[0]) == I32 - 1


def test_huge_block_size_never_gives_a_real_token_slot_minus_one():
    # num_blocks * block_size slots must be representable in int64
    with pytest.raises(KVABIError, match="block_size"):
        FL([1], [0], [[1]], 2**62, num_blocks=4)
    # without num_blocks, the used block ids decide
    with pytest.raises(KVABIError, match="block_size"):
        FL([1], [0], [[3]], 2**62)
    m = FL([1], [0], [[1]], 2**62)
    assert int(m.slot_mapping[0]) == 2**62  # block 1, offset 0: exact, not -1
    m = FL([1], [5], [[0]], 2**62, num_blocks=1)
    assert m.slot_mapping.tolist() == [5]


def test_numpy_and_torch_integer_inputs_are_welcome():
    m = FL(np.array([2], np.uint8), np.array([1], np.int16), np.array([[4]], np.int64), 4)
    assert m.slot_mapping.tolist() == [17, 18]
    torch = pytest.importorskip("torch")
    m = FL(torch.tensor([2]), torch.tensor([1]), torch.tensor([[4]], dtype=torch.int32), 4)
    assert m.slot_mapping.tolist() == [17, 18]
    with pytest.raises(KVABIError, match="query_lens"):
        FL(torch.tensor([2.0]), [1], [[4]], 4)


# -- hand-built metadata -------------------------------------------------------------------
@pytest.mark.parametrize("over,field", [
    (dict(query_start_loc=[0, 1.5, 3]), "query_start_loc"),
    (dict(query_start_loc=[0, 2, 2**32 + 3]), "query_start_loc"),
    (dict(query_start_loc=[0, 2, 3 - 2**32]), "query_start_loc"),
    (dict(query_start_loc=None), "query_start_loc"),
    (dict(seq_lens=[5.0, 5.0]), "seq_lens"),
    (dict(context_lens=[3, True]), "context_lens"),
    (dict(positions=[3, 4, 4.0]), "positions"),
    (dict(positions=[3, 4, 99], slot_mapping=[3, 4, -1],
          query_start_loc=[0, 2, 2], seq_lens=[5, 4]), "positions"),
    (dict(slot_mapping=["3", "4", "13"]), "slot_mapping"),
    (dict(slot_mapping=[3, 4, 2**64]), "slot_mapping"),
    (dict(block_table=[[0, 1.7], [2, 3]]), "block_table"),
    (dict(block_table=[[0, 1], [2]]), "block_table"),
    (dict(block_table=[[0, 1], [2, 2**31]]), "block_table"),
    (dict(block_size=4.0), "block_size"),
    (dict(block_size=0), "block_size"),
    (dict(num_blocks=-5), "num_blocks"),
    (dict(num_blocks="4"), "num_blocks"),
])
def test_hand_built_fields_are_coerced_strictly(over, field):
    with pytest.raises(KVABIError, match=rf"^{field}\b"):
        CommonAttentionMetadata(**_fields(**over))


def test_padding_token_must_have_position_zero():
    m = FL([2, 1], [3, 4], [[0, 1], [2, 3]], 4, num_tokens=4)
    f = _fields(positions=np.r_[m.positions[:3], 99], slot_mapping=m.slot_mapping)
    with pytest.raises(KVABIError, match="positions: padding tokens must have position 0"):
        CommonAttentionMetadata(**f)
    CommonAttentionMetadata(**_fields(positions=m.positions, slot_mapping=m.slot_mapping))


def test_validate_checks_dtypes_of_trusted_construction():
    m = FL([2, 1], [3, 4], [[0, 1], [2, 3]], 4)
    bad = CommonAttentionMetadata._trusted(m.query_start_loc.astype(np.int64), m.seq_lens,
                                           m.context_lens, m.positions, m.slot_mapping,
                                           m.block_table, 4, None)
    with pytest.raises(KVABIError, match="query_start_loc: must be a C-contiguous"):
        bad.validate()
    bad = CommonAttentionMetadata._trusted(m.query_start_loc, m.seq_lens, m.context_lens,
                                           m.positions, m.slot_mapping,
                                           np.asfortranarray(np.zeros((2, 2), np.int32)),
                                           4, None)
    with pytest.raises(KVABIError, match="block_table"):
        bad.validate()


def test_unused_block_table_entries_may_hold_anything_in_int32():
    m = FL([1], [0], [[5, -1, I32, -2**31]], 4, num_blocks=6)
    assert m.slot_mapping.tolist() == [20]


# -- transform arguments -------------------------------------------------------------------
META = FL([2, 1, 3], [3, 0, 5], [[0, 1, 2], [3, 4, 5], [6, 7, 8]], 4, num_blocks=9,
          num_tokens=8)


@pytest.mark.parametrize("call,field", [
    (lambda: T.pad(META, 9.0, 4), "num_tokens"),
    (lambda: T.pad(META, 4.7, 4), "num_tokens"),
    (lambda: T.pad(META, 9, True), "num_reqs"),
    (lambda: T.pad(META, 2**40, 4), "num_tokens"),
    (lambda: T.prefill_skip(META, [1.0]), "keep"),
    (lambda: T.prefill_skip(META, [[1]]), "keep"),
    (lambda: T.prefill_skip(META, "1"), "keep"),
    (lambda: T.prefill_skip(META, [2**63]), "keep"),
    (lambda: T.local_virtual_batches(META, 4.0), "chunk"),
    (lambda: T.local_virtual_batches(META, 0), "chunk"),
    (lambda: T.local_virtual_batches(META, 6), "chunk"),
    (lambda: T.permute_requests(META, [0, 1.9, 2]), "perm"),
    (lambda: T.permute_requests(META, [0, 1, 1]), "perm"),
    (lambda: T.permute_requests(META, None), "perm"),
    (lambda: T.reorder_decode_first(META, 1.5), "decode_threshold"),
    (lambda: T.split_decode_prefill(META, "1"), "decode_threshold"),
    (lambda: T.split_ubatches(META, [2.5]), "token_boundaries"),
    (lambda: T.split_ubatches(META, [[2]]), "token_boundaries"),
    (lambda: T.cascade_split(META, 1.0), "common_prefix_blocks"),
    (lambda: T.cascade_split(META, -1), "common_prefix_blocks"),
    (lambda: T.kv_update_slices(META, 8.0), "num_slices_per_block"),
    (lambda: T.kv_update_slices(META, 0), "num_slices_per_block"),
    (lambda: T.pad("meta", 9, 4), "meta"),
])
def test_transform_arguments_are_coerced_strictly(call, field):
    with pytest.raises(KVABIError, match=rf"^{field}\b"):
        call()


def test_kv_update_slices_never_truncates_slots():
    small = FL([3], [0], [[2]], 4, num_blocks=9)
    s, n = T.kv_update_slices(small, 8)
    assert s.dtype == np.int32 and s[:, 0].tolist() == [8, 0, 3]
    # slots beyond 2**31: int64, exact
    big = FL([3], [0], [[2**28]], 16, num_blocks=2**28 + 1)
    s, n = T.kv_update_slices(big, 8)
    assert s.dtype == np.int64 and int(s[0, 0]) == 2**32 and n == 1
    # without num_blocks the values decide
    s, _ = T.kv_update_slices(FL([3], [0], [[2**28]], 16), 8)
    assert s.dtype == np.int64 and int(s[0, 0]) == 2**32


FIELD_NAMES = {"query_start_loc", "seq_lens", "context_lens", "positions", "slot_mapping",
               "block_table", "block_size", "num_blocks"}


# -- random junk: a KVABIError or sound metadata, nothing else ------------------------------
JUNK = st.one_of(
    st.integers(-2**70, 2**70), st.floats(allow_nan=True), st.booleans(), st.none(),
    st.text(max_size=3), st.complex_numbers(max_magnitude=10),
    st.sampled_from([0, 1, 2, 3, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, -1]))
SHAPES = st.recursive(JUNK, lambda inner: st.lists(inner, max_size=4), max_leaves=12)


@settings(max_examples=FUZZ, deadline=None)
@given(SHAPES, SHAPES, SHAPES, SHAPES, st.one_of(st.none(), SHAPES), st.one_of(st.none(),
                                                                             SHAPES))
def test_from_lengths_on_junk_refuses_or_is_sound(q, c, bt, bs, nb, nt):
    try:
        m = FL(q, c, bt, bs, num_blocks=nb, num_tokens=nt)
    except KVABIError:
        return
    m.validate()  # what was accepted is sound, by the independent check
    ql, cl = np.asarray(q, np.int64), np.asarray(c, np.int64)
    assert m.seq_lens.tolist() == (ql + cl).tolist()


@settings(max_examples=FUZZ, deadline=None)
@given(st.sampled_from(["query_start_loc", "seq_lens", "context_lens", "positions",
                        "slot_mapping", "block_table", "block_size", "num_blocks"]), SHAPES)
def test_hand_built_junk_refuses_or_is_sound(field, value):
    try:
        m = CommonAttentionMetadata(**_fields(**{field: value}))
    except KVABIError as e:
        # a type error names the field; an inconsistency may name the field it shows in
        assert str(e).split(":")[0] in FIELD_NAMES, str(e)
        return
    m.validate()


TRANSFORMS = {
    "pad": lambda a, b: T.pad(META, a, b),
    "prefill_skip": lambda a, b: T.prefill_skip(META, a),
    "local_virtual_batches": lambda a, b: T.local_virtual_batches(META, a),
    "permute_requests": lambda a, b: T.permute_requests(META, a),
    "reorder_decode_first": lambda a, b: T.reorder_decode_first(META, a),
    "split_decode_prefill": lambda a, b: T.split_decode_prefill(META, a),
    "split_ubatches": lambda a, b: T.split_ubatches(META, a),
    "cascade_split": lambda a, b: T.cascade_split(META, a),
    "kv_update_slices": lambda a, b: T.kv_update_slices(META, a),
}


def _metas(x):
    """Every CommonAttentionMetadata in a transform's result."""
    if isinstance(x, CommonAttentionMetadata):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _metas(v)


@settings(max_examples=FUZZ, deadline=None)
@given(st.sampled_from(sorted(TRANSFORMS)), SHAPES, SHAPES)
def test_transform_junk_arguments_refuse_or_give_valid_metadata(name, a, b):
    try:
        out = TRANSFORMS[name](a, b)
    except KVABIError:
        return
    for m in _metas(out):
        m.validate()


@pytest.mark.parametrize("call, field", [
    (lambda: FL([1 << 24 | 1], [0], [[0]], 1 << 25), "query_lens"),
    (lambda: FL([1], [0], [[0]], 4, num_tokens=(1 << 24) + 1), "num_tokens"),
    (lambda: T.pad(META, 2 ** 31 - 1, 3), "num_tokens"),
    (lambda: T.pad(META, 8, 2 ** 31 - 1), "num_reqs"),
    (lambda: T.kv_update_slices(META, 930780229), "num_slices_per_block"),
])
def test_sizes_set_by_a_scalar_are_bounded(call, field):
    # a few bytes of input must not allocate gigabytes (found by the thorough fuzz)
    with pytest.raises(KVABIError, match=f"^{field}:"):
        call()
