"""The per-layer K/V views the CUDA kernels read, taken from the cache handle (a lookup:
:meth:`kvabi.KVCache.kv_view` computes each view once), and the layout conditions the
compiled libraries need, asked once per plan rather than per call."""
from __future__ import annotations


def kv_views(cache, layer: int, mla: bool):
    """(key view, value view) [B, N, H, D] of ``layer`` from a :class:`kvabi.KVCache`; for
    MLA both are the latent."""
    k = cache.kv_view(layer, 0)
    return k, (k if mla else cache.kv_view(layer, 1))


def library_layout_refusals(layout, spec) -> tuple[str, ...]:
    """Why a compiled library's paged kernels cannot address ``layout``: they need D
    contiguous (D is the spec's head dim: the plan's own check)."""
    if layout.stride("D") != layout.itemsize:
        return (f"layout {layout.name or 'custom'} has D stride "
                f"{layout.stride('D') // layout.itemsize}; this library needs D contiguous",)
    return ()
