"""Served parts (``specs/pd.md`` section 3): the named caches an engine serves per KV
cache group, and which pair of parts two engines copy between.

``kv`` (required) holds keys and values in one layout; ``k`` and ``v`` hold them apart
(axis form, over the same memory), for peers that cannot plan ``kv``; an ``image.*`` part
holds each (layer, block, head)'s bytes as one opaque run and moves only to a peer serving
the same name, as whole blocks.
"""
from __future__ import annotations

import attrs

from ..memory.cache import KVCache
from ..util.errors import KVABIError
from ..layout.descriptor import Layout

KV, K, V = "kv", "k", "v"
#: prefix of a part holding opaque block images
IMAGE = "image"
#: most parts per group, longest part name (a grant record's fixed-width field)
MAX_PARTS, NAME_CHARS = 8, 32


def is_image(name: str) -> bool:
    return name.startswith(IMAGE)


def kv_part(parts):
    """The ``kv`` part of a group's ``[(name, cache)]``: what checksums sum."""
    return dict(parts)[KV]


def host_parts(parts):
    """The parts a host tier keeps: the block image where there is one (whole blocks, no
    relayout), else all."""
    image = [(n, c) for n, c in parts if is_image(n)]
    return image or list(parts)


def matching_parts(parts, theirs, g: int, usable=None):
    """[(part, own cache, peer's place)] to pull for group ``g``: the block image when the
    peer serves the same one, else ``kv``, else ``k`` and ``v`` (``specs/pd.md`` section 3);
    ``usable(part, own cache)`` (optional) leaves out parts that cannot be planned (between
    shardings: component layouts).  A place is a message or a tuple of them (one per
    producer rank)."""
    if not isinstance(theirs, dict) or not all(
            isinstance(k, str) and isinstance(v, (str, tuple)) for k, v in theirs.items()):
        raise KVABIError(f"kvabi_handshakes[{g}]: must be an object of part -> message")
    ok = usable or (lambda name, cache: True)
    for name, cache in parts:
        if is_image(name) and name in theirs and ok(name, cache):
            return [(name, cache, theirs[name])]
    mine = dict((n, c) for n, c in parts if not is_image(n))
    served = sorted(k for k in theirs if not is_image(k))
    for want in ((KV,), (K, V)):
        if all(w in mine and w in theirs and ok(w, mine[w]) for w in want):
            return [(w, mine[w], theirs[w]) for w in want]
    why = " in the axis form" if usable is not None else ""
    raise KVABIError(f"kvabi_handshakes[{g}]: the peer serves parts {served}, this engine "
                     f"{sorted(mine)}: no pair to copy between{why}")


def split_kv(cache: KVCache):
    """``[("k", cache), ("v", cache)]``: the keys and the values of a cache whose layout has
    a ``KV`` axis in its memory order, each as a layout without one over the same memory
    (the V planes start one ``KV`` stride in), so it can exchange K and V with a peer that
    cannot hold both in one layout; None where ``KV`` is folded, packed or a plane axis."""
    lay = cache.layout
    if not lay.is_axis_form or "KV" not in lay.order or any("KV" in f for f in lay.folds) \
            or lay.packing:
        return None
    order = tuple(a for a in lay.order if a != "KV")
    ext = {a: lay.extent(a) for a in order}
    out = []
    for kv, part in enumerate((K, V)):
        sub = Layout(order=order, sizes={a: lay.size(a) for a in order + lay.planes},
                     dtype=lay.dtype, planes=lay.planes,
                     extents=ext if lay.extents else None,
                     strides={a: lay.stride(a) for a in order},
                     name=f"{lay.name or 'custom'}.{part}", shard=lay.shard)
        shift = kv * lay.stride("KV")
        out.append((part, KVCache.wrap(sub, [_shifted(p, sub, shift) for p in cache])))
    return out


def _shifted(plane, layout: Layout, nbytes: int):
    """A view of ``plane``'s memory from ``nbytes`` further on, shaped for ``layout``."""
    isz = layout.itemsize
    if hasattr(plane, "as_strided"):  # torch
        return plane.as_strided(layout.plane_shape, layout.plane_strides,
                                plane.storage_offset() + nbytes // isz)
    import numpy as np

    flat = plane.reshape(-1).view(np.uint8)[nbytes:]
    return np.lib.stride_tricks.as_strided(
        flat.view(plane.dtype), layout.plane_shape,
        tuple(s * isz for s in layout.plane_strides))


def with_shard(cache: KVCache, rank: int, size: int, heads: int) -> KVCache:
    """``cache`` over the same memory, its layout stating rank ``rank`` of ``size``'s shard
    of the model's ``heads`` KV heads (a peer of another TP size then knows which global
    head each byte holds); unchanged at size 1.  KVABIError when the cache holds another
    head count than the split gives this rank."""
    from ..model.shard import Shard

    if size == 1:
        return cache
    shard = Shard.tp(rank, size, heads)
    if len(shard.heads) != cache.layout.size("H"):
        raise KVABIError(f"kv_caches: rank {rank} of {size} holds {cache.layout.size('H')} KV "
                         f"heads, the split of {heads} gives it {len(shard.heads)}")
    return KVCache.wrap(attrs.evolve(cache.layout, shard=shard), list(cache))


__all__ = ["IMAGE", "K", "KV", "MAX_PARTS", "NAME_CHARS", "V", "host_parts", "is_image",
           "kv_part", "matching_parts", "split_kv", "with_shard"]
