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
#: dtypes a layout component may also have: raw bytes, and sub-byte values packed two per
#: byte, element ``2i`` in the low nibble (bits 0-3) and ``2i + 1`` in the high nibble
#: (bits 4-7), the order of vLLM's int4 and NVFP4 writers
PACKED_BITS = {"int4": 4, "uint4": 4, "float4_e2m1fn": 4}
COMPONENT_BITS = {**DTYPE_BITS, "uint8": 8, **PACKED_BITS}
COMPONENT_DTYPES = tuple(COMPONENT_BITS)


def check_dtype(name: str, field: str = "dtype") -> str:
    """``name`` if it is a kvabi cache dtype name, else KVABIError naming ``field``."""
    if not isinstance(name, str) or name not in DTYPE_BITS:
        raise KVABIError(f"{field}: unknown dtype {name!r}; expected one of {', '.join(DTYPES)}")
    return name


def check_component_dtype(name, field: str = "dtype") -> str:
    """``name`` if it is a dtype a layout component may have (the cache dtypes, ``uint8``,
    and the packed 4-bit ``int4``, ``uint4``, ``float4_e2m1fn``); else KVABIError naming
    ``field``."""
    if not isinstance(name, str) or name not in COMPONENT_BITS:
        raise KVABIError(f"{field}: unknown dtype {name!r:.60}; expected one of "
                         f"{', '.join(COMPONENT_DTYPES)}")
    return name


def is_packed(name: str) -> bool:
    """Whether a component dtype packs two elements per byte."""
    return check_component_dtype(name) in PACKED_BITS


def unit_bytes(name: str) -> int:
    """Bytes of one storage unit of a component dtype: its itemsize, or 1 for a packed
    dtype (one byte holds two elements)."""
    return max(1, COMPONENT_BITS[check_component_dtype(name)] // 8)


def per_unit(name: str) -> int:
    """Elements per storage unit: 2 for packed dtypes, else 1."""
    return 2 if is_packed(name) else 1


def itemsize(name: str) -> int:
    """Bytes per element of a cache dtype."""
    return DTYPE_BITS[check_dtype(name)] // 8


def tpu_packing(name: str) -> int:
    """Elements of this dtype packed in one 32-bit TPU word (float32 1, 16-bit 2, 8-bit 4)."""
    return 32 // DTYPE_BITS[check_dtype(name)]


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a cache dtype name (bfloat16/float8 via ml_dtypes)."""
    if name in ("uint8",) + tuple(PACKED_BITS):
        return np.dtype(np.uint8)  # raw bytes; packed values are seen as their bytes
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
