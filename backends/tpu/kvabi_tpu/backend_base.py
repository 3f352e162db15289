"""What the two TPU backends share: capabilities, validation, allocation and planning.

Subclasses supply the two computations, ``_write(rows, slot_planes, plan)`` and
``_attend(query, planes, plan)``; everything around them (argument checks, layout views,
cross-layer stores) lives here so that both backends honour one contract.
"""
from __future__ import annotations

import numpy as np

import kvabi
from kvabi import KVABIError

from .cache_format import CacheFormat
from .dtype import SUPPORTED, jnp_dtype
from .plan import TPUPlan, build_plan

KINDS = ("full", "sliding_window", "chunked_local")
LAYOUTS = ("tpu.combined", "tpu.hidden")


class TPUBackendBase(kvabi.Backend):
    """A kvabi backend over jax arrays in the TPU layouts (``tpu.combined``, ``tpu.hidden``,
    and cross-layer layouts with the same per-layer form)."""

    #: query tokens per attention tile
    tile_size: int = 8
    #: update slices handled per grid step of the cache update
    num_slices_per_block: int = 8
    notes: str = ""

    # -- description ---------------------------------------------------------------------
    def _block_size_multiple(self, spec) -> int:
        return 1

    def capabilities(self, spec=None) -> kvabi.Capabilities:
        return kvabi.Capabilities(
            kinds=KINDS, dtypes=SUPPORTED, head_dims=None, block_sizes=None,
            block_size_multiple=1 if spec is None else self._block_size_multiple(spec),
            softcap=True, sinks=True,
            layouts=LAYOUTS if spec is None else self.preferred_layouts(spec),
            notes=self.notes)

    def preferred_layouts(self, spec) -> tuple[str, ...]:
        """tpu.combined then tpu.hidden, less those the preset refuses for ``spec``."""
        out = []
        for name in LAYOUTS:
            try:
                layout = kvabi.Layout.preset(name, spec, num_blocks=1)
                CacheFormat.from_layout(layout, spec)
            except KVABIError:
                continue
            out.append(name)
        return tuple(out)

    # -- arrays --------------------------------------------------------------------------
    def asarray(self, x):
        import jax.numpy as jnp

        return jnp.asarray(x)

    def to_numpy(self, x):
        return np.asarray(x)

    def allocate(self, layout) -> list:
        """Zeroed jax planes shaped ``layout.plane_shape``."""
        import jax.numpy as jnp

        if not isinstance(layout, kvabi.Layout):
            raise KVABIError(f"layout: must be a kvabi.Layout, got {type(layout).__name__}")
        if layout.dtype not in SUPPORTED:
            raise kvabi.UnsupportedError(f"{self.name}: unsupported: layout.dtype "
                                         f"{layout.dtype!r} not in {SUPPORTED}")
        if not layout.is_c_contiguous:
            raise kvabi.UnsupportedError(f"{self.name}: layout.strides: byte-strided or "
                                         f"page-padded layouts are not dense jax arrays")
        dt = jnp_dtype(layout.dtype)
        return [jnp.zeros(layout.plane_shape, dt) for _ in range(layout.num_planes)]

    # -- plan ----------------------------------------------------------------------------
    def plan(self, meta, spec, layout, *, scale=None, softcap=None, sinks=None) -> TPUPlan:
        if not isinstance(spec, kvabi.KVSpec):
            raise KVABIError(f"spec: must be a KVSpec, got {type(spec).__name__}")
        self.check_supported(spec, softcap=softcap, sinks=sinks)
        fmt = CacheFormat.from_layout(layout, spec)
        return build_plan(meta, spec, layout, fmt, scale=scale, softcap=softcap, sinks=sinks,
                          tile_size=self.tile_size,
                          num_slices_per_block=self.num_slices_per_block,
                          to_device=self.asarray)

    def _format(self, layout, plan) -> CacheFormat:
        if not isinstance(plan, TPUPlan):
            raise KVABIError(f"plan: must come from {self.name}.plan(), got "
                             f"{type(plan).__name__}")
        if layout is plan.layout or layout == plan.layout:
            return plan.fmt
        return CacheFormat.from_layout(layout, plan.spec)

    # -- write ---------------------------------------------------------------------------
    def write_kv(self, cache, layout, key, value, plan, *, layer: int = 0):
        """New K/V into the slots of ``plan``; returns the new cache list (functional:
        the input arrays are not modified)."""
        fmt = self._format(layout, plan)
        spec, t = plan.spec, plan.meta.num_tokens
        shape = (t, spec.num_kv_heads, spec.head_dim)
        if value is None:
            raise KVABIError("value: must be an array [T, H, D] (the TPU backends have no MLA)")
        key, value = self.asarray(key), self.asarray(value)
        for field, x in (("key", key), ("value", value)):
            if tuple(x.shape) != shape:
                raise KVABIError(f"{field}: must be [{t}, {shape[1]}, {shape[2]}], "
                                 f"got {tuple(x.shape)}")
        planes = fmt.layer_planes(cache, layout, layer)
        if t == 0:
            return list(cache)
        rows = fmt.token_rows(_pad_rows(key, plan.padded_tokens),
                              _pad_rows(value, plan.padded_tokens))
        slots = self._write(rows, [fmt.slot_view(p) for p in planes], plan)
        return fmt.store_layer(cache, layout, layer,
                               [s.reshape(p.shape) for s, p in zip(slots, planes)])

    # -- attention -----------------------------------------------------------------------
    def attention(self, query, cache, layout, plan, *, layer: int = 0, return_lse=False):
        import jax.numpy as jnp

        fmt = self._format(layout, plan)
        spec, t = plan.spec, plan.meta.num_tokens
        query = self.asarray(query)
        h = spec.num_kv_heads
        if query.ndim != 3 or query.shape[0] != t or query.shape[2] != spec.head_dim:
            raise KVABIError(f"query: must be [{t}, Hq, {spec.head_dim}], "
                             f"got {tuple(query.shape)}")
        hq = query.shape[1]
        if hq == 0 or hq % h:
            raise KVABIError(f"query: query heads must be a positive multiple of the {h} KV "
                             f"heads, got {hq}")
        if not jnp.issubdtype(query.dtype, jnp.floating):
            raise KVABIError(f"query: must be floating point, got {query.dtype}")
        if plan.sinks is not None and plan.sinks.shape != (hq,):
            raise KVABIError(f"sinks: must have one logit per query head ({hq}), "
                             f"got shape {plan.sinks.shape}")
        planes = fmt.layer_planes(cache, layout, layer)
        if t == 0:
            out = jnp.zeros((0, hq, spec.head_dim), query.dtype)
            lse = jnp.zeros((0, hq), jnp.float32)
        else:
            sinks = self.asarray(np.zeros(hq, np.float32) if plan.sinks is None
                                 else plan.sinks)
            out, lse = self._attend(_pad_rows(query, plan.padded_tokens), tuple(planes), plan,
                                    fmt, sinks)
            out, lse = out[:t], lse[:t]
        return (out, lse) if return_lse else out

    # -- the computations ----------------------------------------------------------------
    def _write(self, rows, slot_planes, plan):
        raise NotImplementedError

    def _attend(self, query, planes, plan, fmt, sinks):
        raise NotImplementedError

    @staticmethod
    def _attn_options(plan) -> dict:
        spec = plan.spec
        return dict(scale=plan.scale, softcap=plan.softcap, kind=spec.kind,
                    window=spec.window, chunk=spec.chunk, has_sinks=plan.sinks is not None)


def _pad_rows(x, n: int):
    """``x`` with zero rows appended up to ``n`` rows (padding tokens)."""
    import jax.numpy as jnp

    if x.shape[0] == n:
        return x
    return jnp.pad(x, ((0, n - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))
