"""``Layout.fingerprint()``: a digest of where every byte of a layout lives (``specs/layout.md``,
*Fingerprint*).

The digest is taken over the layout's *placement*, not its descriptor text: the element type,
the logical size of every axis, the global heads it holds (its shard), and for every axis of
size > 1 where index 1 lands, as a plane-index step (axes that select planes, row-major) or
a byte step (axes of the memory order).  Addressing is affine (``layout.md``, *Addressing*:
element 0 at byte 0 of plane 0), so these steps fix the (plane, byte offset) of every
element and two layouts share a fingerprint exactly when they place every element alike:
the informative ``name``, folds, packing, extents beyond the strides and ``plane_bytes``
(none of which moves an element) do not enter it.
"""
from __future__ import annotations

import hashlib
import json

from .shard import shard_of

#: version of the canonical form; the fingerprint starts with it
VERSION = "kv1"
_AXES = ("L", "B", "KV", "N", "H", "D")


def canonical(layout) -> dict:
    """The canonical placement of ``layout`` that the fingerprint digests (JSON-ready)."""
    sizes = [layout.size(a) for a in _AXES]
    plane_step = {}
    step = 1
    for a in reversed(layout.planes):  # row-major plane numbering
        plane_step[a] = step
        step *= layout.size(a)
    planes, strides = [], []
    for a, n in zip(_AXES, sizes):
        if n == 1:  # index 0 only: its step moves nothing
            planes.append(0)
            strides.append(0)
        elif a in plane_step:
            planes.append(plane_step[a])
            strides.append(0)
        else:
            planes.append(0)
            strides.append(layout.stride(a))
    shard = shard_of(layout)
    return {"v": VERSION, "dtype": layout.dtype, "axes": list(_AXES), "sizes": sizes,
            "plane_steps": planes, "byte_steps": strides, "heads": list(shard.heads),
            "of": shard.of}


def fingerprint(layout) -> str:
    """``"kv1:"`` and the first 32 hex digits of the SHA-256 of the canonical placement
    as compact, key-sorted JSON."""
    text = json.dumps(canonical(layout), sort_keys=True, separators=(",", ":"))
    return f"{VERSION}:{hashlib.sha256(text.encode()).hexdigest()[:32]}"
