"""kvabi dtype names as jax dtypes."""
from __future__ import annotations

#: cache dtypes both TPU backends hold and compute on
SUPPORTED = ("float32", "bfloat16")


def jnp_dtype(name: str):
    import jax.numpy as jnp

    return jnp.dtype(name)
