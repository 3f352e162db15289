"""What two engines hold for the same tokens, as numbers to compare within a dtype's
tolerance (tests, the bench): the P/D kit's raw view of a request's KV
(:func:`kvabi.testing.pd.kv_values`, read through the layout's own views, by global head)
turned into float64 ``[layers, 2 (K, V), tokens, heads, head_dim]``."""
from __future__ import annotations

import numpy as np

from kvabi.util.dtypes import numpy_dtype
from kvabi.pd import token_slots
from kvabi.testing.pd import kv_values


def floats(values: dict, dtype: str) -> np.ndarray:
    """float64 ``[layers, 2, tokens, heads, head_dim]`` of one group's
    :func:`~kvabi.testing.pd.kv_values` (``dtype``: the cache's element dtype)."""
    dt = numpy_dtype(dtype)
    heads = sorted(values["key"])
    out = []
    for name in ("key", "value"):
        per_head = [np.ascontiguousarray(values[name][h]).view(dt).astype(np.float64)
                    for h in heads]  # each [tokens, layers, dim]
        out.append(np.stack(per_head, axis=2))  # [tokens, layers, heads, dim]
    return np.stack(out).transpose(2, 0, 1, 3, 4)  # [layers, 2, tokens, heads, dim]


def request_floats(cache, blocks, num_tokens: int, start: int = 0) -> np.ndarray:
    """:func:`floats` of positions ``start .. start + num_tokens - 1`` of a request whose
    blocks in ``cache`` (a KVCache) are ``blocks`` (its ids for positions from 0)."""
    slots = token_slots(blocks, cache.layout.size("N"), start, num_tokens)
    return floats(kv_values(cache, slots), cache.layout.dtype)


__all__ = ["floats", "request_floats"]
