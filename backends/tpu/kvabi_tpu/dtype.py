"""The cache dtypes of the TPU backends."""
from __future__ import annotations

#: cache dtypes both TPU backends hold and compute on
SUPPORTED = ("float32", "bfloat16")
