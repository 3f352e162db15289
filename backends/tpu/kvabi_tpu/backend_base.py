"""What the two TPU backends share: capabilities, validation, allocation and planning.

Nothing here imports jax at module import: without jax the backends still register and
report themselves unavailable.

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

    def __init__(self, *, donate_cache: bool = False, fast_compile: bool = False):
        #: consume the cache arrays passed to write_kv, updating them in place (as an
        #: engine running under jit does); off by default so that inputs stay valid
        self.donate_cache = bool(donate_cache)
        #: compile with XLA's cheap options (about half the compile time, slower code):
        #: for tests and short runs where every step has a new shape
        self.fast_compile = bool(fast_compile)

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
        """New K/V into the slots of ``plan``; returns the new cache list.  The input
        arrays are left as they were unless the backend was made with
        ``donate_cache=True`` (then they are consumed and the update runs in place)."""
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
        idx = self._layer_planes(cache, layout, layer, fmt)
        if t == 0:
            return list(cache)
        from .steps import compiled  # jax is imported on first use only

        impl, args, static = self._write_impl(plan)
        new = compiled("write", donate=self.donate_cache, cheap=self._cheap_compile())(
            tuple(cache[i] for i in idx), key, value, args, fmt=fmt, layer=layer,
            padded_tokens=plan.padded_tokens, impl=impl, static=tuple(sorted(static.items())))
        out = list(cache)
        for i, x in zip(idx, new):
            out[i] = x
        return out

    # -- attention -----------------------------------------------------------------------
    def attention(self, query, cache, layout, plan, *, layer: int = 0, return_lse=False):
        import jax.numpy as jnp

        fmt = self._format(layout, plan)
        spec, t = plan.spec, plan.meta.num_tokens
        query = self.asarray(query)
        hq = kvabi.check_query(query, plan.meta, spec)
        if not jnp.issubdtype(query.dtype, jnp.floating):
            raise KVABIError(f"query: must be floating point, got {query.dtype}")
        kvabi.AttentionOptions(plan.scale, plan.softcap, plan.sinks).check_heads(hq)
        idx = self._layer_planes(cache, layout, layer, fmt)
        if t == 0:
            out = jnp.zeros((0, hq, spec.head_dim), query.dtype)
            lse = jnp.zeros((0, hq), jnp.float32)
        else:
            sinks = self.asarray(np.zeros(hq, np.float32) if plan.sinks is None
                                 else plan.sinks)
            from .steps import compiled

            impl, args, static = self._attend_impl(plan)
            static.update(scale=plan.scale, softcap=plan.softcap, kind=spec.kind,
                          window=spec.window, chunk=spec.chunk,
                          has_sinks=plan.sinks is not None)
            out, lse = compiled("attend", donate=False, cheap=self._cheap_compile())(
                query, tuple(cache[i] for i in idx), args, sinks, fmt=fmt, layer=layer,
                padded_tokens=plan.padded_tokens, impl=impl,
                static=tuple(sorted(static.items())))
        return (out, lse) if return_lse else out

    def _layer_planes(self, cache, layout, layer, fmt) -> tuple[int, ...]:
        """Check the cache list against the layout; indices of ``layer``'s planes."""
        if not isinstance(cache, (list, tuple)) or len(cache) != layout.num_planes:
            raise KVABIError(f"cache: must be a list of the layout's {layout.num_planes} "
                             f"planes, got {type(cache).__name__}")
        for i, p in enumerate(cache):
            if tuple(getattr(p, "shape", ())) != layout.plane_shape:
                raise KVABIError(f"cache[{i}].shape: must be {layout.plane_shape}, got "
                                 f"{tuple(getattr(p, 'shape', ()))}")
        if not (isinstance(layer, (int, np.integer)) and 0 <= layer < layout.num_layers):
            raise KVABIError(f"layer: must be in [0, {layout.num_layers}), got {layer!r}")
        return fmt.plane_indices(layout, int(layer))

    # -- the computations ----------------------------------------------------------------
    def _cheap_compile(self) -> bool:
        """Whether steps compile with cheap XLA options (see :attr:`fast_compile`)."""
        return self.fast_compile

    def _write_impl(self, plan):
        """(update function, its device arrays, its static keywords) for a write:
        ``update(rows, slot_planes, *arrays, **static) -> new slot planes``."""
        raise NotImplementedError

    def _attend_impl(self, plan):
        """(attention function, its device arrays, its static keywords):
        ``attend(query, planes, *arrays, sinks, fmt=, **static) -> (out, lse)``."""
        raise NotImplementedError
