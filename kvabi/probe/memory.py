"""Raw bytes of an engine's cache planes, whatever their shape and dtype.

The probe never interprets a plane through its shape: it reads and writes the bytes from
the plane's first element to its last (its *span*), so a flat buffer, a 4-D tensor or a
strided view over a larger allocation all work.  numpy arrays and CPU torch tensors are
handled through a numpy ``uint8`` view of that memory (no copy); torch tensors on another
device through torch ops on a ``uint8`` view of their storage (only small results cross to
the host).  jax arrays are immutable and refused: a jax engine's ``write`` copies its result
back into numpy planes.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ..util.errors import KVABIError
from ..util.tensors import framework

#: the byte every probed byte is set to first.  0xBB.. is a finite, normal value in every
#: float dtype (-69 in int8), so it survives engines whose writes pass untouched elements
#: through float ops (XLA canonicalises NaN payloads); the markers never use it.
POISON = 0xBB
_POISON64 = np.uint64(int.from_bytes(bytes([POISON]) * 8, "little"))
_CHUNK = 1 << 22  # bytes scanned at a time: memory stays bounded (and cache-sized)


def _span(shape, strides, itemsize: int, field: str) -> int:
    """Bytes from the first element to the end of the last (strides in bytes)."""
    if any(n == 0 for n in shape):
        raise KVABIError(f"{field}: the plane has no elements (shape {tuple(shape)})")
    if any(s < 0 for n, s in zip(shape, strides) if n > 1):
        raise KVABIError(f"{field}: negative strides {tuple(strides)} are not supported")
    return sum((n - 1) * s for n, s in zip(shape, strides)) + itemsize


class PlaneBytes:
    """The span of one plane as bytes: fill, scan for written elements, read and write."""

    def __init__(self, plane, index: int):
        field = f"planes[{index}]"
        fw = framework(plane)
        self._owner = plane  # keeps the memory alive while the views exist
        self._torch = None
        self._views = {}
        if fw == "numpy":
            if not plane.flags.writeable:
                raise KVABIError(f"{field}: the array is read-only; the probe writes markers")
            self.nbytes = _span(plane.shape, plane.strides, plane.itemsize, field)
            addr = plane.__array_interface__["data"][0]
            buf = (ctypes.c_uint8 * self.nbytes).from_address(addr)
            self.u8 = np.ctypeslib.as_array(buf)
        elif fw == "torch":
            import torch

            esz = plane.element_size()
            self.nbytes = _span(plane.shape, [s * esz for s in plane.stride()], esz, field)
            u8 = torch.empty(0, dtype=torch.uint8, device=plane.device)
            u8.set_(plane.untyped_storage(), plane.storage_offset() * esz, (self.nbytes,),
                    (1,))
            if plane.device.type == "cpu":
                self.u8 = u8.numpy()
            else:
                self.u8, self._torch = None, u8
        elif fw == "jax":
            raise KVABIError(f"{field}: jax arrays are immutable; probe numpy planes and let "
                             f"`write` copy the engine's result into them")
        else:
            raise KVABIError(f"{field}: must be a numpy array or a torch tensor, got "
                             f"{type(plane).__name__}")

    # -- whole ranges -------------------------------------------------------------------
    def read(self, lo: int, hi: int) -> np.ndarray:
        """A copy of bytes [lo, hi)."""
        if self._torch is not None:
            return self._torch[lo:hi].cpu().numpy()
        return self.u8[lo:hi].copy()

    def write(self, lo: int, data: np.ndarray) -> None:
        """Bytes ``data`` at ``lo``."""
        if self._torch is not None:
            import torch

            self._torch[lo:lo + len(data)] = torch.from_numpy(np.ascontiguousarray(data)).to(
                self._torch.device)
        else:
            self.u8[lo:lo + len(data)] = data

    def fill(self, lo: int = 0, hi: int | None = None, value: int = POISON) -> None:
        hi = self.nbytes if hi is None else hi
        if self._torch is not None:
            self._torch[lo:hi] = value
        else:
            self.u8[lo:hi] = value

    def written(self, itemsize: int, lo: int = 0, hi: int | None = None,
                limit: int | None = None) -> np.ndarray:
        """Byte offsets (sorted, int64) of the elements in [lo, hi) holding anything but
        poison.  Scanned 8 bytes at a time, in bounded chunks; more than ``limit`` hits is
        refused early (an engine that writes everywhere), so memory stays bounded."""
        hi = self.nbytes if hi is None else hi
        out, count = [], 0
        for start in range(lo, hi, _CHUNK):
            stop = min(hi, start + _CHUNK)
            hits = self._written_chunk(start, stop, itemsize)
            if len(hits):
                out.append(hits)
                count += len(hits)
                if limit is not None and count > limit:
                    raise _TooMany(count)
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def _written_chunk(self, lo: int, hi: int, itemsize: int) -> np.ndarray:
        if self._torch is not None:
            words = self._torch[lo:hi].view(-1, itemsize)
            hit = (words != POISON).any(dim=1).nonzero().flatten().cpu().numpy()
            return lo + hit.astype(np.int64) * itemsize
        seg = self.u8[lo:hi]
        n8 = len(seg) // 8 * 8
        found = []
        if n8:
            w = np.flatnonzero(seg[:n8].view(np.uint64) != _POISON64)
            if len(w):
                b = seg[:n8].reshape(-1, 8)[w].reshape(len(w), 8 // itemsize, itemsize)
                sub = np.nonzero((b != POISON).any(axis=2))
                found.append(w[sub[0]].astype(np.int64) * 8 + sub[1] * itemsize)
        if n8 < len(seg):
            tail = seg[n8:].reshape(-1, itemsize)
            t = np.flatnonzero((tail != POISON).any(axis=1))
            found.append(n8 + t.astype(np.int64) * itemsize)
        hits = np.concatenate(found) if found else np.zeros(0, np.int64)
        return lo + np.sort(hits)

    # -- elements (offsets are multiples of the itemsize: element boundaries) ------------
    def _typed(self, itemsize: int) -> np.ndarray:
        """The span as unsigned words of ``itemsize`` bytes (no copy)."""
        v = self._views.get(itemsize)
        if v is None:
            v = self._views[itemsize] = self.u8[:self.nbytes // itemsize * itemsize].view(
                np.dtype(f"u{itemsize}"))
        return v

    def words(self, offsets: np.ndarray, itemsize: int) -> np.ndarray:
        """The elements at byte ``offsets`` as unsigned integers of ``itemsize`` bytes."""
        idx = np.asarray(offsets, np.int64) // itemsize
        if self._torch is not None:
            import torch

            u8 = self._torch[:self.nbytes // itemsize * itemsize].view(-1, itemsize)
            raw = u8[torch.from_numpy(idx).to(self._torch.device)].cpu().numpy()
            return np.ascontiguousarray(raw).view(np.dtype(f"u{itemsize}")).ravel()
        return self._typed(itemsize)[idx]

    def put_words(self, offsets: np.ndarray, words: np.ndarray) -> None:
        """Write unsigned ``words`` (their itemsize) at byte ``offsets``."""
        isz = words.dtype.itemsize
        idx = np.asarray(offsets, np.int64) // isz
        if self._torch is not None:
            import torch

            dev = self._torch.device
            u8 = self._torch[:self.nbytes // isz * isz].view(-1, isz)
            data = np.ascontiguousarray(words).view(np.uint8).reshape(-1, isz)
            u8[torch.from_numpy(idx).to(dev)] = torch.from_numpy(data).to(dev)
        else:
            self._typed(isz)[idx] = words


class _TooMany(Exception):
    """More written elements than the probe wrote (internal; becomes a KVABIError)."""

    def __init__(self, count: int):
        super().__init__(count)
        self.count = count


def plane_bytes(planes) -> list[PlaneBytes]:
    """A :class:`PlaneBytes` per plane (a list, tuple or KVCache of arrays)."""
    if isinstance(planes, (str, bytes)) or not isinstance(planes, (list, tuple)):
        raise KVABIError(f"planes: must be a list or tuple of the engine's tensors, got "
                         f"{type(planes).__name__}")
    if not planes:
        raise KVABIError("planes: no tensors given")
    return [PlaneBytes(p, i) for i, p in enumerate(planes)]
