"""The per-layer K/V views the CUDA kernels read, taken from the cache handle (a lookup:
:meth:`kvabi.KVCache.kv_view` computes each view once), and the layout conditions the
compiled libraries need, checked once per plan rather than per call."""
from __future__ import annotations

from kvabi import UnsupportedError


def kv_views(cache, layer: int, mla: bool):
    """(key view, value view) [B, N, H, D] of ``layer`` from a :class:`kvabi.KVCache`; for
    MLA both are the latent."""
    k = cache.kv_view(layer, 0)
    return k, (k if mla else cache.kv_view(layer, 1))


def check_library_layout(backend_name: str, layout, spec) -> None:
    """What a compiled library's paged kernels address: D contiguous and exactly
    ``head_dim`` wide, K and V with the same strides (UnsupportedError otherwise)."""
    name = layout.name or "custom"
    if layout.size("D") != spec.head_dim:
        raise UnsupportedError(f"{backend_name}: layout {name} D size {layout.size('D')} "
                               f"differs from head_dim {spec.head_dim}")
    if layout.stride("D") != layout.itemsize:
        raise UnsupportedError(f"{backend_name}: layout {name} has D stride "
                               f"{layout.stride('D') // layout.itemsize}; this library needs "
                               "D contiguous")
