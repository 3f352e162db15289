"""Strict coercion of untrusted scalars and arrays at kvabi's boundary (``specs/security.md``).

Every public entry point turns caller input into kvabi's own types here, once: integers are
integers (no bool, no float, however integral; numpy and torch integer scalars welcome),
integer arrays are rectangular arrays of an integer dtype whose values fit in int64, and
anything else is a :class:`~kvabi.KVABIError` naming the field and the value.  Code behind
the boundary then works on int64 numpy arrays and Python ints without re-checking.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from .errors import KVABIError

INT64_MAX = (1 << 63) - 1
INT32_MAX = (1 << 31) - 1


def _show(value, limit: int = 60) -> str:
    """A short description of ``value`` for a message (never a whole numpy repr)."""
    if isinstance(value, np.ndarray):
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    s = repr(value)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def is_int(value) -> bool:
    """An integer scalar: Python int, numpy integer, or a 0-d integer tensor; not bool."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, (int, np.integer)):
        return True
    dt = getattr(value, "dtype", None)
    if dt is None or getattr(value, "ndim", None) != 0 or "bool" in str(dt):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def as_int(value, field: str, *, lo: int | None = None, hi: int | None = None) -> int:
    """``value`` as a Python int, refusing bool, float, str, None; optionally ``lo <= v <=
    hi`` (``hi`` defaults to int64's maximum: kvabi never holds a larger integer)."""
    if not is_int(value):
        raise KVABIError(f"{field}: must be an integer, got {_show(value)}")
    v = operator.index(value)
    if lo is not None and v < lo:
        raise KVABIError(f"{field}: must be >= {lo}, got {v}")
    top = INT64_MAX if hi is None else hi
    if v > top:
        raise KVABIError(f"{field}: must be <= {top}, got {v}")
    return v


def as_bool(value, field: str) -> bool:
    """A real boolean (``True``/``False``, numpy bool); the string ``"false"`` is not one."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise KVABIError(f"{field}: must be true or false, got {_show(value)}")


def as_float(value, field: str, *, positive: bool = False, finite: bool = True) -> float:
    """A real number (int or float, not bool, not complex, not a string)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, float, np.integer, np.floating)):
        raise KVABIError(f"{field}: must be a number, got {_show(value)}")
    try:
        v = float(value)
    except OverflowError:
        raise KVABIError(f"{field}: must be a finite number, got {_show(value)}") from None
    if finite and not math.isfinite(v):
        raise KVABIError(f"{field}: must be a finite number, got {_show(value)}")
    if positive and not v > 0:
        raise KVABIError(f"{field}: must be > 0, got {_show(value)}")
    return v


def _numpy_of(x, field: str) -> np.ndarray:
    """A numpy array of ``x`` (lists, numpy, torch, jax), or KVABIError for ragged or
    unrepresentable input."""
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__.split(".")[0]
    if mod in ("torch", "jax", "jaxlib"):
        from .tensors import to_numpy

        return to_numpy(x)
    if x is None or isinstance(x, (str, bytes, dict, set)):
        raise KVABIError(f"{field}: must be an array of integers, got {_show(x)}")
    try:
        a = np.asarray(x)
    except (ValueError, TypeError, OverflowError) as e:
        raise KVABIError(f"{field}: must be a rectangular array of integers ({e})") from None
    if a.dtype.kind in "iu" and isinstance(x, (list, tuple)) and _has_bool(x):
        # numpy turns [3, True] into integers: a bool among ints is refused all the same
        raise KVABIError(f"{field}: must hold integers, got a bool entry")
    return a


def _has_bool(seq) -> bool:
    """Whether nested lists/tuples hold a bool (the entries' types collected in C; Python
    steps only through nested rows)."""
    types = set(map(type, seq))
    if bool in types or np.bool_ in types:
        return True
    if list in types or tuple in types:
        return any(_has_bool(v) for v in seq if isinstance(v, (list, tuple)))
    return False


def _object_ints(a: np.ndarray, field: str) -> np.ndarray:
    """An object array (Python ints beyond int64, Fractions, Decimals, None, ... land there)
    as int64, every entry checked: the entries' types are collected in C, and only entries
    of a type that is not plainly an integer are looked at one by one."""
    flat = a.ravel()
    types = set(map(type, flat))
    odd = [t for t in types if t is bool or not issubclass(t, (int, np.integer))]
    if odd:
        for v in flat:
            if type(v) in odd and not is_int(v):
                raise KVABIError(f"{field}: must hold integers, got an entry {_show(v)}")
        # the odd types were integer scalars (0-d integer tensors): read them as ints
        flat = np.array([operator.index(v) for v in flat], dtype=object)
    try:
        return flat.astype(np.int64).reshape(a.shape)
    except OverflowError:
        raise KVABIError(f"{field}: values must fit in int64") from None


def int_array(x, field: str, *, ndim: int | None = 1, lo: int | None = None,
              hi: int | None = None) -> np.ndarray:
    """``x`` as an int64 numpy array (a copy only where the dtype differs).

    Accepts lists and numpy/torch/jax arrays of an integer dtype (an empty list too);
    refuses bool, float, complex, object and string arrays, ragged nesting, values outside
    int64 and, when given, values outside ``[lo, hi]``.
    """
    a = _numpy_of(x, field)
    if ndim is not None and a.ndim != ndim and not (a.size == 0 and a.ndim == 1 and ndim > 1):
        raise KVABIError(f"{field}: must be {ndim}-D, got shape {a.shape}")
    if a.size == 0:
        return np.zeros(a.shape if a.ndim == (ndim or a.ndim) else (0,) * ndim, np.int64)
    kind = a.dtype.kind
    if kind == "O":
        a = _object_ints(a, field)
        kind = "i"
    if kind not in "iu":
        raise KVABIError(f"{field}: must hold integers, got dtype {a.dtype}")
    if kind == "u" and a.dtype.itemsize == 8 and int(a.max()) > INT64_MAX:
        raise KVABIError(f"{field}: values must fit in int64, got {int(a.max())}")
    a = a.astype(np.int64, copy=False)
    if lo is not None or hi is not None:
        mn, mx = int(a.min()), int(a.max())
        if lo is not None and mn < lo:
            raise KVABIError(f"{field}: values must be >= {lo}, got {mn}")
        if hi is not None and mx > hi:
            raise KVABIError(f"{field}: values must be <= {hi}, got {mx}")
    return a


def real_array(x, field: str) -> np.ndarray:
    """``x`` as a numpy array of real numbers (float or integer dtype, bf16/fp8 included);
    complex, bool, object and string arrays are refused."""
    a = _numpy_of(x, field)
    k = a.dtype.kind
    if k in "fiu" or (k == "V" and a.dtype.itemsize in (1, 2)):  # ml_dtypes' bf16/fp8
        return a
    raise KVABIError(f"{field}: must hold real numbers, got dtype {a.dtype}")


def checked(value: int, field: str) -> int:
    """``value`` (a Python int from exact arithmetic) if it fits in int64, else
    KVABIError: offsets, spans and sizes are int64 everywhere in kvabi."""
    if not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise KVABIError(f"{field}: {value} does not fit in int64")
    return value


def checked_bytes(value: int, field: str, what: str) -> int:
    """:func:`checked` for a byte count: KVABIError ``"<field>: <what> (<value> bytes) does
    not fit in int64"``."""
    try:
        return checked(value, field)
    except KVABIError:
        raise KVABIError(f"{field}: {what} ({value} bytes) does not fit in int64") from None


def _dtype_bounds(dt: np.dtype) -> tuple[int, int]:
    info = np.iinfo(dt)
    return int(info.min), int(info.max)


def index_array(x, field: str, dtype=np.int32, *, ndim: int = 1, lo: int | None = None,
                hi: int | None = None) -> np.ndarray:
    """``x`` as a C-contiguous numpy array of the integer ``dtype`` (int32 or int64 index
    arrays), refusing what :func:`int_array` refuses and any value outside ``[lo, hi]`` or
    the dtype's range, so the cast never wraps.  An array already of that dtype, shape rank
    and contiguity is returned as it is (no copy); its range is checked only where
    ``lo``/``hi`` are narrower than the dtype's."""
    dt = np.dtype(dtype)
    dlo, dhi = _dtype_bounds(dt)
    lo = dlo if lo is None else max(lo, dlo)
    hi = dhi if hi is None else min(hi, dhi)
    if isinstance(x, np.ndarray) and x.dtype == dt and x.ndim == ndim and \
            x.flags.c_contiguous:
        a = x
    else:
        a = int_array(x, field, ndim=ndim)
    if a.size and (a.dtype != dt or lo > dlo or hi < dhi):
        mn, mx = int(a.min()), int(a.max())
        if mn < lo:
            raise KVABIError(f"{field}: values must be >= {lo}, got {mn}")
        if mx > hi:
            raise KVABIError(f"{field}: values must be <= {hi}, got {mx}")
    return np.ascontiguousarray(a, dt)
