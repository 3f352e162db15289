"""The kvabi Layout of the KV cache vLLM hands a connector, one per KV cache group.

vLLM 0.32 allocates every layer of a group in one buffer and gives each layer a strided
``[blocks, kv_heads, block_size, 2 * head_dim]`` view (the ``C`` of its layout names).  The
byte strides of those views, and the distance between the layers' first bytes, give the
outer axes (``L``, ``B``, ``H``) of the layout exactly, whichever of the six names is in
use (cross-layer ``BLHNC`` included).  Inside one block-head the views only say "2 * N * D
elements"; how the kernels split them is the attention backend's business:

- vLLM's own CPU backend (``CPU_ATTN``) views a block-head as ``[2 * block_size, head_dim]``
  and takes the first half as keys: all keys, then all values (``KV`` before ``N``), although
  the allocation's name says ``[N, 2 * D]``;
- otherwise the name's meaning: each token's key then value (``N`` before ``KV``).

The connector checks the result against the engine's own cache write once at start
(:func:`verify_group`), so a backend whose kernels write another order is refused before any
byte moves.
"""
from __future__ import annotations

import logging

import numpy as np

from kvabi import KVABIError, KVCache, Layout
from kvabi import tensors as tensors_mod

log = logging.getLogger(__name__)

#: interior orders of a block-head: keys then values, or key and value per token
KV_SPLIT, KV_PACKED = "kv_split", "kv_packed"


def interior_of(backend_cls) -> str:
    """How ``backend_cls`` (a vLLM attention backend class) splits a block-head's
    ``2 * N * D`` elements; a class may say so itself with ``kvabi_kv_interior``."""
    own = getattr(backend_cls, "kvabi_kv_interior", None)
    if own in (KV_SPLIT, KV_PACKED):
        return own
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another platform's build
        CPUAttentionBackend = None
    if CPUAttentionBackend is not None and isinstance(backend_cls, type) and \
            issubclass(backend_cls, CPUAttentionBackend):
        return KV_SPLIT
    return KV_PACKED


def group_layout(tensors, *, interior: str = KV_PACKED, name: str | None = None) -> Layout:
    """The Layout of one KV cache group from its layers' vLLM views (in layer order).

    KVABIError naming what does not fit: a view that is not 4-D, an interior that is not
    dense, layers whose first bytes are not evenly spaced, an odd content size."""
    if not tensors:
        raise KVABIError("kv_caches: a KV cache group has no layers")
    t0 = tensors[0]
    if t0.dim() != 4:
        raise KVABIError(f"kv_caches: vLLM views are [blocks, heads, block_size, content], "
                         f"got shape {tuple(t0.shape)}")
    nb, nh, bs, c = (int(x) for x in t0.shape)
    if c % 2:
        raise KVABIError(f"kv_caches: content size {c} is not 2 * head_dim (MLA caches "
                         "are not served by this connector)")
    d = c // 2
    isz = t0.element_size()
    sb, sh, sn, sc = (int(s) * isz for s in t0.stride())
    if sc != isz or (bs > 1 and sn != c * isz):
        raise KVABIError(f"kv_caches: a block-head is not {bs * c} dense elements (strides "
                         f"{tuple(t0.stride())})")
    for i, t in enumerate(tensors[1:], 1):
        if tuple(t.shape) != tuple(t0.shape) or t.stride() != t0.stride() or \
                t.dtype != t0.dtype:
            raise KVABIError(f"kv_caches: layer {i} of the group differs from layer 0 in "
                             f"shape, strides or dtype")
    ptrs = np.array([t.data_ptr() for t in tensors], np.int64)
    steps = np.diff(ptrs)
    if steps.size and (np.any(steps != steps[0]) or steps[0] <= 0):
        raise KVABIError(f"kv_caches: the layers' first bytes are not evenly spaced "
                         f"({steps[:4].tolist()}...)")
    interior_strides = {KV_SPLIT: {"KV": bs * d * isz, "N": d * isz, "D": isz},
                        KV_PACKED: {"N": c * isz, "KV": d * isz, "D": isz}}
    if interior not in interior_strides:
        raise KVABIError(f"interior: must be {KV_SPLIT!r} or {KV_PACKED!r}, got {interior!r}")
    strides = {"B": sb, "H": sh, **interior_strides[interior]}
    sizes = {"L": len(tensors), "B": nb, "H": nh, "N": bs, "KV": 2, "D": d}
    # A group of one layer: its L stride never matters; put it outside everything.
    strides["L"] = int(steps[0]) if steps.size else sb * nb + sh * nh
    # Memory order: by stride, outermost first (size-1 axes anywhere they fit).
    order = sorted(strides, key=lambda a: (-strides[a], ("L", "B", "H", "KV", "N", "D").index(a)))
    return Layout(order=order, sizes=sizes, dtype=tensors_mod.dtype_name(t0), strides=strides,
                  name=name)


def group_cache(tensors, layout: Layout) -> KVCache:
    """A KVCache over vLLM's own memory: one plane starting at layer 0's first byte."""
    t0 = tensors[0]
    plane = t0.as_strided(layout.plane_shape, layout.plane_strides, t0.storage_offset())
    return KVCache.wrap(layout, [plane])


def engine_writer(attn_layers, tensors):
    """``write(layer, slot_mapping, key, value)`` through the engine's own cache write
    (each layer's ``impl.do_kv_cache_update``): numpy in, the vLLM tensors written."""
    import torch

    def write(layer, slot_mapping, key, value):
        mod = attn_layers[layer]
        mod.impl.do_kv_cache_update(
            mod, torch.from_numpy(np.ascontiguousarray(key)),
            torch.from_numpy(np.ascontiguousarray(value)), tensors[layer],
            torch.from_numpy(np.asarray(slot_mapping, np.int64)))
    return write


def verify_group(layout: Layout, cache: KVCache, write) -> bool:
    """Check ``layout`` against what the engine's write really does (kvabi.probe); True
    when checked, False when this kvabi has no probe.  KVABIError on a mismatch."""
    try:
        from kvabi.probe import verify_layout
    except ImportError:
        log.warning("kvabi.probe is not available: the cache layout %s is not verified "
                    "against the engine's write", layout.name)
        return False
    verify_layout(layout, list(cache), write)
    return True
