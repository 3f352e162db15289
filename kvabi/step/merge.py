"""Merge two partial attention results over disjoint key sets by log-sum-exp.

Used by cascade attention (shared prefix + per-request suffix), split-KV decoding and
context parallelism: if ``(out_i, lse_i)`` is softmax attention over key set K_i, the merge
is attention over K_1 ∪ K_2.
"""
from __future__ import annotations

import numpy as np

from ..util.errors import KVABIError


def _namespace(x):
    """The array module of ``x``: its array-API namespace, torch, or numpy."""
    if hasattr(x, "__array_namespace__"):
        return x.__array_namespace__()
    if type(x).__module__.startswith("torch"):
        import torch

        return torch
    return np


def _check_real(x, name: str) -> None:
    """An array (numpy, torch, jax, array API) of real floating numbers."""
    dt = getattr(x, "dtype", None)
    if dt is None or not hasattr(x, "shape"):
        raise KVABIError(f"{name}: must be an array, got {type(x).__name__}")
    s = str(dt).replace("torch.", "")
    if not (s.startswith(("float", "bfloat")) or s in ("half", "double")):
        raise KVABIError(f"{name}: must hold real floating numbers, got dtype {s}")


def _cast(x, like):
    return x.astype(like.dtype) if hasattr(x, "astype") else x.to(like.dtype)


def merge_attention(out1, lse1, out2, lse2):
    """``(out, lse)`` of attention over the union of two disjoint key sets.

    ``out*`` are ``[..., D]`` and ``lse*`` ``[...]`` (natural log of the softmax
    denominator, e.g. ``[T, H, D]`` and ``[T, H]``).  An empty part has lse ``-inf``; its
    output may be anything (even NaN) and is ignored.  When both parts are empty the result
    is output 0 and lse ``-inf``.  Works on numpy, torch, jax or any array-API arrays; the
    output keeps ``out1``'s dtype, the lse ``lse1``'s.
    """
    for name, x in (("out1", out1), ("lse1", lse1), ("out2", out2), ("lse2", lse2)):
        _check_real(x, name)
    s1, s2 = tuple(out1.shape), tuple(out2.shape)
    if s1 != s2:
        raise KVABIError(f"out2: shape must equal out1's {s1}, got {s2}")
    for name, lse in (("lse1", lse1), ("lse2", lse2)):
        if tuple(lse.shape) != s1[:-1]:
            raise KVABIError(f"{name}: shape must be out1's without the last axis {s1[:-1]}, "
                             f"got {tuple(lse.shape)}")
    xp = _namespace(out1)
    m = xp.maximum(lse1, lse2)
    live = m > -float("inf")
    m0 = xp.where(live, m, xp.zeros_like(m))  # avoids -inf - -inf = NaN
    w1 = xp.exp(lse1 - m0)
    w2 = xp.exp(lse2 - m0)
    total = w1 + w2
    denom = xp.where(live, total, xp.ones_like(total))
    lse = xp.where(live, m0 + xp.log(denom), m)
    zero = xp.zeros_like(out1)
    # An empty part's output is garbage; 0 * NaN would poison the sum, so mask it.
    a = xp.where(w1[..., None] > 0, out1, zero) * (w1 / denom)[..., None]
    b = xp.where(w2[..., None] > 0, out2, zero) * (w2 / denom)[..., None]
    return _cast(a + b, out1), _cast(lse, lse1)
