"""The kit's oracle of "the same KV": the raw bits of every component (keys, values,
scales) of given tokens, read through the layout's own views (``KVCache.component_view``),
independently of plans, staging and checksums, keyed by global KV head."""
from __future__ import annotations

import numpy as np

from ...model.shard import shard_of
from ...util.tensors import to_numpy


def kv_values(cache, slots) -> dict:
    """{component: {global head: uint8 [tokens, layers, bytes]}}: the bytes of each head's
    record of each component at each slot and layer (components without an ``H`` stride:
    under every head of the layout); slot -1: a token not held (zeros), and ``"_held"``
    the bool mask of the slots held."""
    lay = cache.layout
    slots = np.asarray(slots, np.int64)
    held = slots >= 0
    slots = np.where(held, slots, 0)
    bs = lay.size("N")
    heads = shard_of(lay).heads
    out = {"_held": held}
    for name in lay.component_names:
        per_layer = []
        for layer in range(lay.num_layers):
            v = to_numpy(cache.component_view(layer, name))  # [B, N, H, E]
            b = slots // bs if v.shape[0] > 1 else np.zeros_like(slots)
            n = slots % bs if v.shape[1] > 1 else np.zeros_like(slots)
            x = np.ascontiguousarray(v[b, n])  # [tokens, H or 1, E]
            per_layer.append(x.view(np.uint8).reshape(x.shape[0], x.shape[1], -1))
        arr = np.stack(per_layer, axis=1)  # [tokens, layers, H or 1, bytes]
        arr[~held] = 0
        out[name] = {g: arr[:, :, min(j, arr.shape[2] - 1)] for j, g in enumerate(heads)}
    return out


def merge(ranks) -> dict:
    """One :func:`kv_values` of several ranks' (by global head)."""
    out: dict = {}
    for r in ranks:
        for name, by_head in r.items():
            if name == "_held":
                out["_held"] = by_head if "_held" not in out else out["_held"] & by_head
            else:
                out.setdefault(name, {}).update(by_head)
    return out


def differences(got, want, names=("key", "value")) -> list[str]:
    """What differs between two :func:`kv_values` (per group lists), as short sentences:
    the components both hold among ``names``, every global head ``want`` holds, at the
    tokens both hold."""
    out = []
    for g, (a, b) in enumerate(zip(got, want)):
        if a["_held"].shape != b["_held"].shape:
            out.append(f"group {g}: {a['_held'].size} tokens, {b['_held'].size} expected")
            continue
        both = a["_held"] & b["_held"]
        if not both.any() and b["_held"].any():
            out.append(f"group {g}: no token held on both sides")
        for name in names:
            if name not in a or name not in b:
                continue
            for head, w in b[name].items():
                x = a[name].get(head)
                if x is None:
                    out.append(f"group {g} {name} head {head}: missing")
                elif x.shape != w.shape:
                    out.append(f"group {g} {name} head {head}: shape {x.shape} != {w.shape}")
                elif not np.array_equal(x[both], w[both]):
                    t = int(np.flatnonzero(both & (x != w).any(axis=(1, 2)))[0])
                    out.append(f"group {g} {name} head {head}: token {t} differs")
    if len(got) != len(want):
        out.append(f"{len(got)} groups, {len(want)} expected")
    return out


__all__ = ["differences", "kv_values", "merge"]
