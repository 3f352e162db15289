"""``Layout.fingerprint()``: a digest of where every byte of a layout lives (``specs/layout.md``,
*Fingerprint*).

The digest is taken over the layout's *placement*, not its descriptor text: the sizes of
``L, B, N, H``, the global heads it holds (its shard), and per component (an axis-form
layout by the components it derives) its name, dtype, element count, first plane and byte
offset, and for every axis of size > 1 where index 1 lands, as a plane step (``L``) or a
byte step.  Addressing is affine per component (``layout.md``, *Addressing*), so these fix
the (plane, byte offset) of every element, and two layouts share a fingerprint exactly when
they place every element alike, in either form: the informative ``name``, the form, folds,
packing, extents beyond the strides and ``plane_bytes`` (none of which moves an element)
do not enter it.
"""
from __future__ import annotations

import hashlib
import json

from ..model.shard import shard_of

#: version of the canonical form; the fingerprint starts with it
VERSION = "kv2"
_AXES = ("L", "B", "N", "H", "E")


def _component(c, sizes: dict) -> dict:
    steps = [c.strides.get(a, 0) if sizes[a] > 1 else 0 for a in _AXES[:-1]]
    steps.append(c.elem_stride if c.units > 1 else 0)
    return {"name": c.name, "dtype": c.dtype, "count": c.count, "plane": c.plane,
            "offset": c.offset, "byte_steps": steps,
            "plane_step": c.plane_strides.get("L", 0) if sizes["L"] > 1 else 0}


def canonical(layout) -> dict:
    """The canonical placement of ``layout`` that the fingerprint digests (JSON-ready)."""
    sizes = {a: layout.size(a) for a in _AXES[:-1]}
    shard = shard_of(layout)
    return {"v": VERSION, "axes": list(_AXES), "sizes": [sizes[a] for a in _AXES[:-1]],
            "components": [_component(c, sizes) for c in layout.components],
            "heads": list(shard.heads), "of": shard.of}


def fingerprint(layout) -> str:
    """``"kv2:"`` and the first 32 hex digits of the SHA-256 of the canonical placement
    as compact, key-sorted JSON."""
    text = json.dumps(canonical(layout), sort_keys=True, separators=(",", ":"))
    return f"{VERSION}:{hashlib.sha256(text.encode()).hexdigest()[:32]}"
