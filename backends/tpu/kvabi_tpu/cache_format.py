"""How a kvabi :class:`~kvabi.Layout` maps onto the arrays the TPU backends read and write.

Two per-layer forms are understood (both also inside cross-layer layouts, where the L axis
is part of a plane's memory order and the per-layer tensor is a slice of it):

- ``combined`` (preset ``tpu.combined``): one tensor ``[B, N, 2H, Dpad]`` with K and V
  interleaved on the head axis (k0, v0, k1, v1, ...), split ``[B, N, 2H/p, p, Dpad]`` when the
  layout packs ``p`` values per 32-bit word (``p`` is 1 for float32).
  Combined head ``c`` sits at ``(c // p, c % p)``.
- ``hidden`` (preset ``tpu.hidden``): separate K and V tensors ``[B, N, H*Dpad]``.

Everything here works on jax arrays (values, not refs) except :meth:`CacheFormat.head_kv`,
which the Pallas kernel also applies to loaded VMEM values.
"""
from __future__ import annotations

import attrs

import kvabi
from kvabi import KVABIError, UnsupportedError

COMBINED = "combined"
HIDDEN = "hidden"


@attrs.frozen
class CacheFormat:
    """The TPU view of one layout: form, sizes and where each layer's tensors are."""

    kind: str
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    #: physical head width (head_dim padded, e.g. to a multiple of 128 for tpu.combined)
    dpad: int
    #: values per packed group of the combined-head axis (a ``p`` dim), or None (no such dim)
    packing: int | None
    dtype: str
    #: dimension of L in each plane tensor, or None when layers are separate planes / absent
    layer_dim: int | None

    # -- construction --------------------------------------------------------------------
    @classmethod
    def from_layout(cls, layout, spec) -> "CacheFormat":
        """Validate ``layout`` against ``spec`` and classify it; KVABIError names the field."""
        if not isinstance(layout, kvabi.Layout):
            raise KVABIError(f"layout: must be a kvabi.Layout, got {type(layout).__name__}")
        if spec.is_mla or not layout.has_kv:
            raise UnsupportedError("layout: the TPU backends have no MLA form (need K and V)")
        if layout.dtype != spec.dtype:
            raise KVABIError(f"layout.dtype: must equal spec.dtype {spec.dtype!r}, "
                             f"got {layout.dtype!r}")
        want = {"N": spec.block_size, "H": spec.num_kv_heads, "D": spec.head_dim}
        for axis, v in want.items():
            if layout.size(axis) != v:
                raise KVABIError(f"layout.sizes.{axis}: must be {v} for this spec, "
                                 f"got {layout.size(axis)}")
        if spec.head_dim_v != spec.head_dim:
            raise UnsupportedError(f"spec.head_dim_v: TPU layouts need head_dim_v == head_dim "
                                   f"({spec.head_dim}), got {spec.head_dim_v}")
        padded = sorted(a for a in (layout.extents or {}) if layout.extent(a) != layout.size(a))
        if set(padded) - {"D"}:
            raise UnsupportedError(f"layout.extents: only D may be padded for the TPU "
                                   f"backends, got padded axes {padded}")
        if not layout.is_c_contiguous:
            raise UnsupportedError("layout.strides: the TPU backends hold planes as dense jax "
                                   "arrays; byte-strided or page-padded layouts are not "
                                   "expressible (use page_align=1)")
        axes = list(layout.view_axes)
        layer_dim = None
        if "L" in layout.order:
            if ("L",) not in axes:
                raise UnsupportedError("layout.folds: L is folded with another axis; no "
                                       "per-layer view")
            layer_dim = axes.index(("L",))
            axes.pop(layer_dim)
        axes = tuple(axes)
        kv_planes = "KV" in layout.planes
        packed = layout.packing is not None
        comb = (("B",), ("N",), ("H", "KV")) + ((("p",),) if packed else ()) + (("D",),)
        if not kv_planes and axes == comb:
            kind = COMBINED
        elif kv_planes and axes == (("B",), ("N",), ("H", "D")):
            kind = HIDDEN
        else:
            raise UnsupportedError(
                f"layout: per-layer axes {axes} (K/V {'planes' if kv_planes else 'in one '}"
                f"{'tensor' if not kv_planes else ''}) are neither the tpu.combined form "
                f"[B, N, (H, KV), D] nor the tpu.hidden form [B, N, (H, D)] with K/V planes")
        fmt = cls(kind, layout.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim,
                  layout.extent("D"), layout.packing if kind == COMBINED else None,
                  spec.dtype, layer_dim)
        if fmt.packing is not None and fmt.block_size % fmt.packing:
            raise KVABIError(f"block_size: {layout.name or 'layout'} packs {fmt.packing} "
                             f"{spec.dtype} values per 32-bit word; the page size must be a "
                             f"multiple of {fmt.packing}, got {fmt.block_size}")
        return fmt

    # -- per-layer tensors ---------------------------------------------------------------
    @property
    def num_layer_planes(self) -> int:
        return 1 if self.kind == COMBINED else 2

    def plane_indices(self, layout, layer: int) -> tuple[int, ...]:
        """Indices into the cache list of the planes holding ``layer``."""
        return tuple(int(layout.plane_index(layer, kv)) for kv in range(self.num_layer_planes))

    def layer_tensors(self, planes, layer: int) -> tuple:
        """The per-layer tensors of ``layer`` from its planes (slicing L away if present);
        traceable, so that inside a jitted step XLA reads the slice in place."""
        if self.layer_dim is None:
            return tuple(planes)
        idx = (slice(None),) * self.layer_dim + (layer,)
        return tuple(p[idx] for p in planes)

    def put_layer(self, planes, layer: int, tensors) -> tuple:
        """``planes`` with the per-layer ``tensors`` of ``layer`` stored back."""
        if self.layer_dim is None:
            return tuple(tensors)
        idx = (slice(None),) * self.layer_dim + (layer,)
        return tuple(p.at[idx].set(t) for p, t in zip(planes, tensors))

    # -- rows of new tokens --------------------------------------------------------------
    @property
    def slot_shape(self) -> tuple[int, ...]:
        """Shape of one token's slot in each per-layer plane."""
        if self.kind == COMBINED:
            c = 2 * self.num_kv_heads
            if self.packing is not None:
                return (c // self.packing, self.packing, self.dpad)
            return (c, self.dpad)
        return (self.num_kv_heads * self.dpad,)

    @property
    def write_slot_shape(self) -> tuple[int, ...]:
        """The slot shape cache writes see: padded head dim last, so that a write can
        leave the padding bytes as they are (hidden planes split [H, Dpad] only if padded)."""
        if self.kind == HIDDEN and self.dpad != self.head_dim:
            return (self.num_kv_heads, self.dpad)
        return self.slot_shape

    def token_rows(self, key, value) -> tuple:
        """New K/V [T, H, D] as rows in the cache dtype, one array per plane, shaped
        ``[T, *write_slot_shape]`` except that the last dim is head_dim."""
        import jax.numpy as jnp

        from kvabi.util.dtypes import numpy_dtype

        dt = numpy_dtype(self.dtype)
        t, h, d = key.shape
        *lead, last = self.write_slot_shape
        shape = (t, *lead, last - (self.dpad - d))  # the padded lanes dropped
        if self.kind == COMBINED:
            kv = jnp.stack([key.astype(dt), value.astype(dt)], axis=2)
            return (kv.reshape(shape),)
        return tuple(x.astype(dt).reshape(shape) for x in (key, value))

    def write_view(self, plane):
        """A per-layer plane as [B, N, *write_slot_shape] (itself unless hidden and padded)."""
        return plane.reshape((self.num_blocks, self.block_size) + self.write_slot_shape)

    # -- keys and values of fetched pages ------------------------------------------------
    def head_kv(self, pages, h: int):
        """(k, v) [n, head_dim] of KV head ``h`` from fetched pages, one [P, N, ...] array
        per plane (``h`` static); n = P * N."""
        d = self.head_dim
        if self.kind == COMBINED:
            (kv,) = pages
            n = kv.shape[0] * kv.shape[1]
            if self.packing is not None:
                p = self.packing
                k = kv[:, :, (2 * h) // p, (2 * h) % p, :d]
                v = kv[:, :, (2 * h + 1) // p, (2 * h + 1) % p, :d]
            else:
                k = kv[:, :, 2 * h, :d]
                v = kv[:, :, 2 * h + 1, :d]
            return k.reshape(n, d), v.reshape(n, d)
        kp, vp = pages
        n = kp.shape[0] * kp.shape[1]
        lo = h * self.dpad
        return kp[:, :, lo:lo + d].reshape(n, d), vp[:, :, lo:lo + d].reshape(n, d)

    def all_kv(self, pages):
        """(k, v) [P*N, H, head_dim] of all heads from pages, one [P, N, ...] per plane."""
        d, h = self.head_dim, self.num_kv_heads
        if self.kind == COMBINED:
            (kv,) = pages
            kv = kv.reshape(kv.shape[0] * kv.shape[1], h, 2, self.dpad)
            return kv[:, :, 0, :d], kv[:, :, 1, :d]
        return tuple(x.reshape(x.shape[0] * x.shape[1], h, self.dpad)[..., :d] for x in pages)
