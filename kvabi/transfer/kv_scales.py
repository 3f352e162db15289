"""Per-tensor KV scales between peers (``specs/transfer.md``, *Static scales*).

A ``per_tensor`` quantized cache (``specs/semantics.md`` section 11) stores codes whose
meaning is ``code * scale`` with one static float32 scale per layer for keys and one for
values: layer state, not cache bytes, so no byte plan moves them.  They travel in the
handshake instead (``kv_scales``: one ``[k_scale, v_scale]`` per layer of the layout's
``L`` axis), and a puller compares them with the scales its own layers read with before any
byte moves: the same codes under other scales are other values, so a mismatch is refused
naming the layer and the scale, never silently rescaled.
"""
from __future__ import annotations

import numpy as np

from ..model.quant import as_scale
from ..util.errors import KVABIError

#: largest number of layers a handshake's kv_scales may list (as many as a layout's L)
MAX_LAYERS = 65536


def scales_to_json(kv_scales) -> list[list[float]]:
    """``[[k_scale, v_scale], ...]`` of a sequence of per-layer pairs, each the float32 it
    is used as (KVABIError naming ``kv_scales[i]``)."""
    out = []
    for i, pair in enumerate(kv_scales):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise KVABIError(f"kv_scales[{i}]: must be a pair [k_scale, v_scale], got "
                             f"{pair!r:.60}")
        out.append([as_scale(pair[0], f"kv_scales[{i}].k_scale"),
                    as_scale(pair[1], f"kv_scales[{i}].v_scale")])
    return out


def parse_kv_scales(value, num_layers: int) -> tuple[tuple[float, float], ...]:
    """An untrusted handshake's ``kv_scales``: a list of ``num_layers`` pairs of positive
    float32 normal numbers; KVABIError naming the field otherwise."""
    if not isinstance(value, list):
        raise KVABIError(f"kv_scales: must be a list of [k_scale, v_scale] pairs, got "
                         f"{type(value).__name__}")
    if len(value) != num_layers or len(value) > MAX_LAYERS:
        raise KVABIError(f"kv_scales: the layout has {num_layers} layers, the message lists "
                         f"{len(value)} pairs")
    for i, pair in enumerate(value):  # JSON numbers only: a bool or string is refused
        if isinstance(pair, list):
            for j, x in enumerate(pair):
                if isinstance(x, bool) or not isinstance(x, (int, float)):
                    raise KVABIError(f"kv_scales[{i}][{j}]: must be a number, got {x!r:.40}")
    return tuple((k, v) for k, v in scales_to_json(value))


def check_same_scales(ours, theirs, what: str = "kv_scales") -> None:
    """KVABIError unless the peer's per-layer scales (``theirs``, from its handshake, or
    None: an unscaled cache) are exactly ``ours`` (this cache's, or None), naming the first
    layer and scale that differ."""
    if ours is None and theirs is None:
        return
    if ours is None or theirs is None:
        who = "the peer's cache has none" if theirs is None else "this cache has none"
        raise KVABIError(f"{what}: one side stores codes under static scales and {who}: "
                         f"its bytes would be read as other values")
    ours = np.asarray(scales_to_json(ours), np.float64)
    theirs = np.asarray(scales_to_json(theirs), np.float64)
    if ours.shape != theirs.shape:
        raise KVABIError(f"{what}: the peer lists {len(theirs)} layers' scales, this cache "
                         f"{len(ours)}")
    diff = np.argwhere(ours != theirs)
    if len(diff):
        i, j = (int(x) for x in diff[0])
        name = ("k_scale", "v_scale")[j]
        raise KVABIError(f"{what}[{i}].{name}: the peer's codes are under "
                         f"{float(theirs[i, j])!r}, this cache reads them with "
                         f"{float(ours[i, j])!r} (the same bytes would be "
                         f"{theirs[i, j] / ours[i, j]:.4g}x off)")


__all__ = ["check_same_scales", "parse_kv_scales", "scales_to_json"]
