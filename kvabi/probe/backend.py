"""A kvabi backend's ``write_kv`` as the ``write(layer, slot_mapping, key, value)`` that
:func:`~kvabi.probe.infer_layout` and :func:`~kvabi.probe.verify_layout` call."""
from __future__ import annotations

import numpy as np

from ..memory.cache import KVCache
from ..step.metadata import CommonAttentionMetadata
from ..util.tensors import FRAMEWORKS, convert


def backend_writer(backend, layout, spec, cache=None):
    """``(planes, write)`` for the probe: the planes of ``cache`` (default: one the backend
    allocates for ``layout``) and a ``write`` that calls ``backend.write_kv`` with a plan of
    one single-token request per slot (so any slot can be written).

    numpy and torch planes are the cache's own memory, written in place.  jax arrays are
    immutable: ``planes`` are numpy copies, and each write runs on jax copies of them and
    copies the result back (the cache given is never touched).
    """
    cache = backend.allocate(layout) if cache is None else KVCache.wrap(layout, cache)
    jax = cache.framework == "jax"
    planes = [np.array(p) for p in cache] if jax else list(cache)
    fw = backend.framework if backend.framework in FRAMEWORKS else "numpy"
    bs = spec.block_size

    def write(layer, slots, key, value):
        slots = np.asarray(slots, np.int64)
        meta = CommonAttentionMetadata.from_lengths(
            query_lens=np.ones(len(slots), np.int64), context_lens=slots % bs,
            block_table=(slots // bs)[:, None], block_size=bs, num_blocks=layout.num_blocks)
        plan = backend.plan(meta, spec, layout, num_q_heads=spec.num_kv_heads)
        k = convert(key, fw)
        v = None if value is None else convert(value, fw)
        if jax:
            handle = KVCache.wrap(layout, [convert(np.array(p), "jax") for p in planes])
            new = backend.write_kv(plan, handle, key=k, value=v, layer=layer)
            for dst, src in zip(planes, new):
                dst[...] = np.asarray(src)
        else:
            backend.write_kv(plan, cache, key=k, value=v, layer=layer)

    return planes, write
