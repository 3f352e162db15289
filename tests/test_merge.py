"""merge_attention: two partial softmax results over disjoint keys merge into the whole."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kvabi import KVABIError, merge_attention


def _attend(q, k, v, mask):
    """Direct float64 softmax attention: q [T, D], k/v [M, D], mask [T, M] -> out, lse."""
    logits = np.where(mask, q @ k.T, -np.inf)
    out = np.zeros((len(q), v.shape[1]))
    lse = np.full(len(q), -np.inf)
    for t in range(len(q)):
        if mask[t].any():
            w = np.exp(logits[t] - logits[t].max())
            out[t] = w @ v / w.sum()
            lse[t] = np.log(np.exp(logits[t][mask[t]]).sum())
    return out, lse


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 8), st.integers(0, 2**32 - 1))
def test_merge_equals_union(T, M, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, 4))
    k = rng.standard_normal((M, 4))
    v = rng.standard_normal((M, 3))
    part = rng.integers(0, 2, M).astype(bool)  # which part each key belongs to
    visible = rng.random((T, M)) < 0.7          # rows may end up empty in one or both parts
    o1, l1 = _attend(q, k, v, visible & part)
    o2, l2 = _attend(q, k, v, visible & ~part)
    o1[np.isinf(l1)] = np.nan  # an empty part's output is garbage and must be ignored
    want_o, want_l = _attend(q, k, v, visible)
    out, lse = merge_attention(o1[:, None], l1[:, None], o2[:, None], l2[:, None])
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out[:, 0], want_o, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(lse[:, 0], want_l, rtol=1e-10, atol=1e-12)


def test_both_empty():
    o = np.full((2, 1, 3), np.nan)
    lse = np.full((2, 1), -np.inf)
    out, l_ = merge_attention(o, lse, o, lse)
    assert (out == 0).all() and np.isneginf(l_).all()


def test_dtypes_kept():
    o = np.ones((2, 2, 4), np.float16)
    lse = np.zeros((2, 2), np.float32)
    out, l_ = merge_attention(o, lse, o, lse)
    assert out.dtype == np.float16 and l_.dtype == np.float32
    np.testing.assert_allclose(l_, np.log(2.0), rtol=1e-6)
    np.testing.assert_allclose(out, 1.0)


def test_torch_tensors():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    o1, o2 = rng.standard_normal((2, 3, 2, 5))
    l1, l2 = rng.standard_normal((2, 3, 2))
    l2[0, 0] = -np.inf
    want_o, want_l = merge_attention(o1, l1, o2, l2)
    out, lse = merge_attention(*(torch.from_numpy(x) for x in (o1, l1, o2, l2)))
    assert isinstance(out, torch.Tensor)
    np.testing.assert_allclose(out.numpy(), want_o, rtol=1e-12)
    np.testing.assert_allclose(lse.numpy(), want_l, rtol=1e-12)
    # direct check of the -inf row: the merged row is part 1's
    np.testing.assert_allclose(out.numpy()[0, 0], o1[0, 0], rtol=1e-12)


@pytest.mark.parametrize("shapes, field", [
    (((2, 3), (2,), (2, 4), (2,)), "out2"),
    (((2, 3), (3,), (2, 3), (2,)), "lse1"),
    (((2, 3), (2,), (2, 3), (2, 1)), "lse2"),
])
def test_shape_errors(shapes, field):
    with pytest.raises(KVABIError, match=field):
        merge_attention(*(np.zeros(s) for s in shapes))


@pytest.mark.parametrize("i,bad,match", [
    (0, [[1.0]], "out1: must be an array"),
    (1, None, "lse1: must be an array"),
    (2, np.zeros((2, 3), complex), "out2: must hold real floating numbers"),
    (3, np.zeros(2, np.int64), "lse2: must hold real floating numbers"),
    (0, np.zeros((2, 3), "U1"), "out1: must hold real floating numbers"),
])
def test_non_real_arrays_are_refused(i, bad, match):
    args = [np.zeros((2, 3)), np.zeros(2), np.zeros((2, 3)), np.zeros(2)]
    args[i] = bad
    with pytest.raises(KVABIError, match=match):
        merge_attention(*args)
