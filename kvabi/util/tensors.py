"""Tensor conversion between numpy, torch and jax, in one public place.

Bit-exact for every cache dtype: numpy holds bfloat16 and float8 through ``ml_dtypes``;
torch and jax hold them natively.  Where a zero-copy path exists it is taken (numpy ->
torch via ``from_numpy``, torch <-> jax via DLPack on the CPU); otherwise the data is copied
once.  torch and jax are imported only when an argument or a request needs them, so the
core stays free of both at import time.
"""
from __future__ import annotations

import numpy as np

from .dtypes import check_dtype
from .dtypes import dtype_name as _dtype_name
from .dtypes import numpy_dtype
from .errors import KVABIError

FRAMEWORKS = ("numpy", "torch", "jax")
# numpy cannot hand ml_dtypes arrays to torch: they cross as same-width integers, bit for bit.
_RAW = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


def framework(x) -> str | None:
    """``"numpy"``, ``"torch"`` or ``"jax"`` for an array of that framework, else None
    (decided from the type's module: nothing is imported)."""
    if isinstance(x, np.ndarray):
        return "numpy"
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return "torch"
    if mod in ("jax", "jaxlib"):
        return "jax"
    return None


def dtype_name(x) -> str:
    """The kvabi dtype name of an array (or a numpy/torch/jax dtype, or a name)."""
    return _dtype_name(getattr(x, "dtype", x))


def to_numpy(x) -> np.ndarray:
    """A numpy array of ``x`` (a view where the framework allows; bf16/fp8 as ml_dtypes)."""
    fw = framework(x)
    if fw == "torch":
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        name = str(t.dtype).replace("torch.", "")
        if name in _RAW:
            import torch

            raw = t.view(getattr(torch, _RAW[name]))  # same itemsize: a view at any strides
            return raw.numpy().view(numpy_dtype(name))
        return t.numpy()
    return np.asarray(x)


def to_torch(x, device=None, dtype: str | None = None):
    """A torch tensor of ``x`` on ``device`` (default: the input's, or the CPU), optionally
    converted to the kvabi dtype ``dtype``."""
    import torch

    fw = framework(x)
    if fw == "torch":
        t = x
    elif fw == "jax" and device in (None, "cpu") and _jax_on_cpu(x):
        try:  # zero copy on the CPU
            t = torch.from_dlpack(x)
        except Exception:  # noqa: BLE001 - dtypes DLPack lacks: take the numpy path
            t = _torch_from_numpy(np.asarray(x))
    else:
        t = _torch_from_numpy(np.asarray(x))
    if device is not None:
        t = t.to(device)
    if dtype is not None:
        t = t.to(torch_dtype(dtype))
    return t


def to_jax(x, dtype: str | None = None):
    """A jax array of ``x`` (DLPack from CPU torch tensors, no copy), optionally converted
    to the kvabi dtype ``dtype``."""
    import jax

    fw = framework(x)
    if fw == "jax":
        a = x
    elif fw == "torch" and x.device.type == "cpu" and x.is_contiguous():
        try:
            a = jax.dlpack.from_dlpack(x.detach())
        except Exception:  # noqa: BLE001
            a = jax.device_put(np.array(to_numpy(x)))
    else:
        # on the host, then one device_put: jnp.asarray and astype would each compile a
        # small XLA computation per new shape (a cliff for steps of many sizes).  The
        # device_put of a host array may read it after returning (CPU: it aliases), so it
        # gets an array nobody else holds: the caller may reuse its buffer at once.
        h = to_numpy(x)
        convert = dtype is not None and str(h.dtype) != dtype
        return jax.device_put(h.astype(numpy_dtype(dtype)) if convert else np.array(h))
    if dtype is not None and str(a.dtype) != dtype:
        a = a.astype(numpy_dtype(dtype))
    return a


def convert(x, to: str, *, device=None):
    """``x`` in framework ``to`` (one of :data:`FRAMEWORKS`)."""
    if to == "numpy":
        return to_numpy(x)
    if to == "torch":
        return to_torch(x, device)
    if to == "jax":
        return to_jax(x)
    raise KVABIError(f"framework: must be one of {FRAMEWORKS}, got {to!r}")


def torch_dtype(name: str):
    """The torch dtype of a kvabi dtype name (``uint8`` for raw and packed bytes)."""
    import torch

    from .dtypes import PACKED_BITS

    if name == "uint8" or name in PACKED_BITS:
        return torch.uint8
    return getattr(torch, check_dtype(name))


def _torch_from_numpy(a: np.ndarray):
    import torch

    name = str(a.dtype)
    if name in _RAW:
        raw = np.ascontiguousarray(a).view(_RAW[name])
        return torch.from_numpy(raw).view(torch_dtype(name))
    if a.dtype.kind not in "fiub":
        raise KVABIError(f"array: dtype {a.dtype} cannot become a torch tensor")
    if not a.flags.writeable or not (a.flags.c_contiguous or a.flags.f_contiguous):
        a = np.array(a)
    return torch.from_numpy(a)


def _jax_on_cpu(x) -> bool:
    try:
        return all(d.platform == "cpu" for d in x.devices())
    except Exception:  # noqa: BLE001
        return False


class ConvertOnce:
    """``convert`` of an array to ``framework`` (optionally to kvabi ``dtype``, on
    ``device``), made once per array object and reused while it lives: for arrays kvabi
    hands out read-only, such as the checked sinks ``kvabi.Backend`` passes a backend (the
    same object for the same sinks tensor, call after call)."""

    def __init__(self, framework: str, *, dtype: str | None = None, device=None,
                 limit: int = 4096):
        self.framework, self.dtype, self.device, self.limit = framework, dtype, device, limit
        self._memo: dict = {}

    def __call__(self, a):
        import weakref

        hit = self._memo.get(id(a))
        if hit is not None and hit[0]() is a:
            return hit[1]
        x = a if self.dtype is None else np.asarray(a).astype(numpy_dtype(self.dtype))
        x = convert(x, self.framework, device=self.device)
        if len(self._memo) >= self.limit:
            self._memo.clear()
        self._memo[id(a)] = (weakref.ref(a), x)
        return x
