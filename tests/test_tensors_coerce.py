"""kvabi.util.tensors (bit-exact conversion) and kvabi.util.coerce (strict boundary types)."""
from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvabi import KVABIError, tensors
from kvabi.util import coerce
from kvabi.util.dtypes import DTYPES, numpy_dtype

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("name", DTYPES)
def test_round_trips_are_bit_exact(name):
    jax = pytest.importorskip("jax")  # noqa: F841
    bits = np.random.default_rng(0).integers(0, 256, size=64, dtype=np.uint8)
    width = numpy_dtype(name).itemsize
    a = bits.view(np.dtype(f"u{width}")).view(numpy_dtype(name)).reshape(-1, 2)
    for fw in ("torch", "jax"):
        x = tensors.convert(a, fw)
        assert tensors.framework(x) == fw and tensors.dtype_name(x) == name
        back = tensors.to_numpy(x)
        assert back.dtype == a.dtype
        assert back.tobytes() == a.tobytes()
    # torch -> jax -> torch keeps the bits too (DLPack or the numpy path)
    t = tensors.to_torch(a)
    assert tensors.to_numpy(tensors.to_torch(tensors.to_jax(t))).tobytes() == a.tobytes()


def test_numpy_to_torch_shares_memory():
    a = np.zeros(4, np.float32)
    t = tensors.to_torch(a)
    t[1] = 5
    assert a[1] == 5


def test_unknown_framework_and_dtype():
    with pytest.raises(KVABIError, match="framework"):
        tensors.convert(np.zeros(1), "tensorflow")
    with pytest.raises(KVABIError, match="dtype"):
        tensors.dtype_name(np.zeros(1, np.complex64))


@pytest.mark.parametrize("bad", [True, 1.0, 1.5, "3", None, 2 ** 63, complex(1, 0)])
def test_as_int_refuses(bad):
    with pytest.raises(KVABIError, match="field"):
        coerce.as_int(bad, "field")


def test_as_int_accepts_integer_scalars():
    assert coerce.as_int(np.int32(3), "f") == 3
    assert coerce.as_int(torch.tensor(4), "f") == 4
    with pytest.raises(KVABIError, match=">= 0"):
        coerce.as_int(-1, "f", lo=0)


@pytest.mark.parametrize("bad", [
    [1.9], [[1.7]], [True, False], [1 + 2j], ["1"], [[1, 2], [3]], None, "12", [2 ** 64],
    np.array([1.0]), torch.tensor([1.5]), np.array([2 ** 63], np.uint64)])
def test_int_array_refuses(bad):
    with pytest.raises(KVABIError, match="field"):
        coerce.int_array(bad, "field", ndim=None)


@given(st.lists(st.integers(-2 ** 63, 2 ** 63 - 1), max_size=20))
def test_int_array_keeps_every_int64(xs):
    a = coerce.int_array(xs, "f")
    assert a.dtype == np.int64 and a.tolist() == xs
    assert coerce.int_array(torch.tensor(xs, dtype=torch.int64), "f").tolist() == xs


_NOT_INTS = [Fraction(5, 2), Fraction(4, 2), Decimal("2.5"), Decimal("2"), 2.5, 2.0, None,
             True, np.bool_(False), "2", 1j, np.float64(2.0), torch.tensor(2.5),
             torch.tensor([2]), object()]


@given(st.integers(0, 1500), st.integers(0, 1500), st.sampled_from(_NOT_INTS),
       st.sampled_from(["list", "object array", "object 2-D"]), st.booleans())
def test_every_entry_is_checked_not_a_prefix(n, where, bad, form, big):
    """One non-integer anywhere among many integers (Python ints beyond int64 too, which
    put even a list into an object array) is refused by name, never truncated or read as
    an int, never a TypeError."""
    where = min(where, n)
    xs = [2**63 + i if big and i % 7 == 0 else i for i in range(n)]
    xs.insert(where, bad)
    if form == "list":
        x = xs
    else:
        x = np.empty(len(xs), dtype=object)
        x[:] = xs
        if form == "object 2-D" and len(xs) % 2 == 0:
            x = x.reshape(2, -1)
    with pytest.raises(KVABIError, match="^field: "):
        coerce.int_array(x, "field", ndim=None)


@given(st.lists(st.integers(-2 ** 63, 2 ** 63 - 1), max_size=40), st.booleans())
def test_object_arrays_of_integers_are_read_exactly(xs, tensors_too):
    """Object arrays holding Python, numpy and 0-d torch integers: every value, exactly."""
    x = np.empty(len(xs), dtype=object)
    for i, v in enumerate(xs):
        x[i] = (np.int64(v) if i % 3 == 1 else torch.tensor(v) if tensors_too and i % 3 == 2
                else v)
    a = coerce.int_array(x, "f")
    assert a.dtype == np.int64 and a.tolist() == xs
    with pytest.raises(KVABIError, match="f: values must fit in int64"):
        coerce.int_array(np.array(xs + [2**63], dtype=object), "f")


def test_int_array_bounds_and_empties():
    assert coerce.int_array([], "f").shape == (0,)
    with pytest.raises(KVABIError, match="<= 9"):
        coerce.int_array([1, 10], "f", hi=9)
    with pytest.raises(KVABIError, match="2-D"):
        coerce.int_array([1, 2], "f", ndim=2)


def test_as_bool_and_as_float():
    assert coerce.as_bool(np.bool_(True), "f") is True
    for bad in ("false", 0, None):
        with pytest.raises(KVABIError, match="true or false"):
            coerce.as_bool(bad, "f")
    for bad in (float("nan"), float("inf"), True, "1", 1j):
        with pytest.raises(KVABIError, match="f:"):
            coerce.as_float(bad, "f")
    with pytest.raises(KVABIError, match="> 0"):
        coerce.as_float(0.0, "f", positive=True)


def test_real_array_refuses_complex_and_strings():
    for bad in (np.zeros(2, np.complex64), np.array(["a"]), np.array([True])):
        with pytest.raises(KVABIError, match="real numbers"):
            coerce.real_array(bad, "key")
    assert coerce.real_array(np.zeros(2, numpy_dtype("bfloat16")), "key").shape == (2,)


def test_checked():
    assert coerce.checked(2 ** 63 - 1, "x") == 2 ** 63 - 1
    with pytest.raises(KVABIError, match="int64"):
        coerce.checked(2 ** 63, "x")
