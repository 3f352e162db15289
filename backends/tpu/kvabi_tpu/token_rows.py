"""Token rows at the backend boundary of a bucketed step, without compiling per length.

A bucketed step runs its jitted computations on arrays of the bucket's row count, so that
the compile key is the bucket's.  The caller's arrays hold the step's real row count: they
are padded with zero rows on the way in and cut on the way out.  Any jax operation on an
array of a new shape compiles (a pad or a slice too: ~0.1 s each on a busy host), so on a
CPU device both happen on the host (a jax CPU array is host memory: no transfer).  On an
accelerator a jitted pad or slice is compiled once per row count; an engine that pads its
metadata to a token bucket (``kvabi.transforms.pad``) never needs either.
"""
from __future__ import annotations

import functools

import numpy as np

from .env import jax_status


def _on_host() -> bool:
    return jax_status()[2] == "cpu"


def pad_rows(x, n: int):
    """The jax array ``x`` [t, ...] with zero rows appended up to ``n`` rows."""
    if x.shape[0] == n:
        return x
    import jax

    if not _on_host():
        return _pad_jit(n)(x)
    h = np.asarray(x)
    out = np.zeros((n,) + h.shape[1:], h.dtype)
    out[:h.shape[0]] = h
    return jax.device_put(out)


def first_rows(x, t: int):
    """The first ``t`` rows of the jax array ``x``."""
    if x.shape[0] == t:
        return x
    import jax

    if not _on_host():
        return _slice_jit(t)(x)
    return jax.device_put(np.array(np.asarray(x)[:t]))  # a copy: device_put may alias it


@functools.lru_cache(maxsize=None)
def _pad_jit(n: int):
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda x: jnp.pad(x, ((0, n - x.shape[0]),) + ((0, 0),) * (x.ndim - 1)))


@functools.lru_cache(maxsize=None)
def _slice_jit(t: int):
    import jax

    return jax.jit(lambda x: x[:t])
