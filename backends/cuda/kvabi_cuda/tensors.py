"""torch tensors for kvabi layouts: dtypes, allocation, per-layer views, numpy conversion."""
from __future__ import annotations

import numpy as np

from kvabi import KVABIError, UnsupportedError

_TORCH = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
          "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2", "int8": "int8"}
# numpy cannot hold bf16/fp8 natively: they travel as same-width unsigned ints, bit for bit.
_BITS_AS = {"bfloat16": ("uint16", "int16"), "float8_e4m3fn": ("uint8", "uint8"),
            "float8_e5m2": ("uint8", "uint8")}


def torch_dtype(name: str):
    """The torch dtype of a kvabi dtype name."""
    import torch

    if name not in _TORCH:
        raise KVABIError(f"dtype: unknown dtype {name!r}")
    return getattr(torch, _TORCH[name])


def dtype_name(t) -> str:
    """The kvabi dtype name of a torch tensor's dtype."""
    return str(t.dtype).replace("torch.", "")


def allocate(layout, device) -> list:
    """Zeroed torch planes shaped ``layout.plane_shape``, strided over a buffer of
    ``layout.plane_nbytes`` (padding included) so that byte offsets match the layout."""
    import torch

    dt = torch_dtype(layout.dtype)
    n = -(-layout.plane_nbytes // layout.itemsize)
    planes = []
    for _ in range(layout.num_planes):
        buf = torch.zeros(n, dtype=dt, device=device)
        planes.append(buf.as_strided(layout.plane_shape, layout.plane_strides))
    return planes


def kv_views(layout, cache, layer: int, mla: bool, d_contiguous: bool = True):
    """(key view, value view) [B, N, H, D] of ``layer``; for MLA both are the latent.

    With ``d_contiguous`` raises UnsupportedError unless D has stride 1 (what the compiled
    libraries address).
    """
    k = layout.kv_view(cache, layer, 0)
    v = k if mla else layout.kv_view(cache, layer, 1)
    for name, t in (("key", k), ("value", v)):
        if d_contiguous and t.stride(3) != 1:
            raise UnsupportedError(f"layout: {layout.name or 'custom'} {name} view has D "
                                   f"stride {t.stride(3)}; this library needs D contiguous")
    return k, v


def to_torch(x, device, dtype: str | None = None):
    """A torch tensor on ``device`` from a numpy array (bf16/fp8 via ml_dtypes) or tensor."""
    import torch

    if isinstance(x, torch.Tensor):
        t = x.to(device)
        return t if dtype is None else t.to(torch_dtype(dtype))
    a = np.asarray(x)
    name = _numpy_name(a.dtype)
    if name in _BITS_AS:
        u, s = _BITS_AS[name]
        t = torch.from_numpy(np.ascontiguousarray(a).view(s if name == "bfloat16" else u))
        t = t.view(torch_dtype(name))
    else:
        t = torch.from_numpy(np.ascontiguousarray(a))
    t = t.to(device)
    return t if dtype is None else t.to(torch_dtype(dtype))


def to_numpy(t) -> np.ndarray:
    """A numpy copy of a tensor (bf16/fp8 as ml_dtypes arrays, bit for bit)."""
    import torch

    if not isinstance(t, torch.Tensor):
        return np.asarray(t)
    t = t.detach().cpu()
    name = dtype_name(t)
    if name in _BITS_AS:
        import ml_dtypes

        raw = t.contiguous().view(torch.int16 if name == "bfloat16" else torch.uint8).numpy()
        return raw.view(getattr(ml_dtypes, name))
    return t.numpy()


def _numpy_name(dt) -> str:
    s = str(np.dtype(dt))
    return {"bfloat16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn",
            "float8_e5m2": "float8_e5m2"}.get(s, s)
