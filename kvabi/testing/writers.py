"""Cache writers built from a layout's offset formula: the oracle the probe is tested
against (``kvabi.probe``), and a stand-in for an engine's write in benchmarks.

:func:`layout_writer` knows nothing of presets, views or kernels: each element's bytes go
to ``layout.byte_offset(...)`` of its plane, as raw words.
"""
from __future__ import annotations

import numpy as np

from ..probe.memory import plane_bytes
from ..util.errors import KVABIError


def layout_writer(layout, planes):
    """``write(layer, slot_mapping, key, value)`` placing every element of ``key`` /
    ``value`` ([tokens, heads, dim], value None for MLA) at the byte offset ``layout``
    gives it in ``planes`` (numpy arrays or torch tensors of any shape); slot -1 is
    skipped."""
    mem = plane_bytes(planes)
    isz = layout.itemsize
    bs = layout.size("N")
    heads, dims = layout.size("H"), layout.size("D")
    h = np.arange(heads)[None, :, None]
    d = np.arange(dims)[None, None, :]

    def write(layer, slot_mapping, key, value):
        slots = np.asarray(slot_mapping, np.int64)
        real = slots >= 0
        b = (slots[real] // bs)[:, None, None]
        n = (slots[real] % bs)[:, None, None]
        parts = [(0, key)] + ([(1, value)] if layout.has_kv else [])
        for kv, x in parts:
            if x is None:
                raise KVABIError("value: None, but the layout has key and value")
            words = np.ascontiguousarray(np.asarray(x)[real]).view(np.dtype(f"u{isz}"))
            p, off = layout.byte_offset(layer=layer, block=b, kv=kv, token=n, head=h, dim=d)
            p, off = np.broadcast_to(p, words.shape).ravel(), np.broadcast_to(
                off, words.shape).ravel()
            for q in np.unique(p):
                sel = p == q
                mem[int(q)].put_words(off[sel], words.ravel()[sel])

    return write
