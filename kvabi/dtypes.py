"""KV cache element dtypes: names, sizes, and their numpy equivalents.

numpy has no bfloat16 or float8; ``ml_dtypes`` (the JAX team's numpy extension types)
supplies them, so the reference oracle can hold every cache dtype natively.
"""
from __future__ import annotations

import numpy as np

from .errors import KVABIError

#: dtype name -> bits per element
DTYPE_BITS = {
    "float32": 32,
    "float16": 16,
    "bfloat16": 16,
    "float8_e4m3fn": 8,
    "float8_e5m2": 8,
    "int8": 8,
}
DTYPES = tuple(DTYPE_BITS)


def check_dtype(name: str, field: str = "dtype") -> str:
    """``name`` if it is a kvabi cache dtype name, else KVABIError naming ``field``."""
    if not isinstance(name, str) or name not in DTYPE_BITS:
        raise KVABIError(f"{field}: unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return name


def itemsize(name: str) -> int:
    """Bytes per element of a cache dtype."""
    return DTYPE_BITS[check_dtype(name)] // 8


def tpu_packing(name: str) -> int:
    """Elements of this dtype packed in one 32-bit TPU word (float32 1, 16-bit 2, 8-bit 4)."""
    return 32 // DTYPE_BITS[check_dtype(name)]


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a cache dtype name (bfloat16/float8 via ml_dtypes)."""
    check_dtype(name)
    if name in ("float32", "float16", "int8"):
        return np.dtype(name)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))


def dtype_name(dt) -> str:
    """The kvabi dtype name of a numpy/torch/jax dtype (or a name)."""
    s = str(dt).replace("torch.", "").replace("dtype(", "").strip("')\"")
    s = {"<class 'ml_dtypes.bfloat16'>": "bfloat16"}.get(s, s)
    if s not in DTYPE_BITS:
        raise KVABIError(f"dtype: {s!r} is not a kvabi cache dtype ({', '.join(DTYPES)})")
    return s
