"""What the two TPU backends share: capabilities, layouts, allocation, the step's device
arrays, and the jitted write and attention around their computations.

Nothing here imports jax at module import: without jax the backends still register and
report themselves unavailable.  Every argument check is :class:`kvabi.Backend`'s.

Subclasses supply the two computations (``_write_impl``, ``_attend_impl``); everything
around them (layer planes, cross-layer stores, buckets, compiles) lives here.
"""
from __future__ import annotations

import functools

import numpy as np

import kvabi
from kvabi import KVABIError
from kvabi.util.dtypes import numpy_dtype
from kvabi.util.tensors import ConvertOnce, to_jax

from .cache_format import CacheFormat
from .dtype import SUPPORTED
from .plan import TPUSteps, build_steps
from .step_buckets import StepBuckets
from .token_rows import first_rows, pad_rows

KINDS = ("full", "sliding_window", "chunked_local")
LAYOUTS = ("tpu.combined", "tpu.hidden")


class TPUBackendBase(kvabi.Backend):
    """A kvabi backend over jax arrays in the TPU layouts (``tpu.combined``, ``tpu.hidden``,
    and cross-layer layouts with the same per-layer form).

    jax arrays are immutable, so the cache is functional at the boundary: ``write_kv``
    *consumes* the cache it is given (its buffers are donated to the jitted update, which
    then runs in place, at a cost that grows with the tokens written, not the cache size)
    and returns the new one.  Always use the returned cache.
    """

    framework = "jax"
    #: query tokens per attention tile
    tile_size: int = 8
    #: update slices handled per grid step of the cache update
    num_slices_per_block: int = 8
    #: the plan's write arrays: "slots" (block, offset per token) or "slices" (DMA runs)
    write_form: str = "slots"
    notes: str = ""

    def __init__(self, *, donate_cache: bool = True, fast_compile: bool = False):
        #: donate the cache planes written by write_kv (in-place update; the argument is
        #: consumed).  False keeps the argument valid and copies the planes on every write
        #: (for comparisons only: the copy costs the whole plane)
        self.donate_cache = bool(donate_cache)
        #: compile with XLA's cheap options (about half the compile time, slower code):
        #: for tests and short runs where every step has a new shape
        self.fast_compile = bool(fast_compile)
        #: [(spec, layout, StepBuckets)] declared by warmup
        self._declared: list = []
        #: executables compiled by warmup, by :func:`kvabi_tpu.steps.signature`
        self._compiled: dict = {}

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
    def allocate(self, layout) -> kvabi.KVCache:
        """A zeroed jax :class:`kvabi.KVCache` for ``layout`` (dense layouts only)."""
        if not isinstance(layout, kvabi.Layout):
            raise KVABIError(f"layout: must be a kvabi.Layout, got {type(layout).__name__}")
        if layout.dtype not in SUPPORTED:
            raise kvabi.UnsupportedError(f"{self.name}: unsupported: layout.dtype "
                                         f"{layout.dtype!r} not in {SUPPORTED}")
        if not layout.is_c_contiguous:
            raise kvabi.UnsupportedError(f"{self.name}: layout.strides: byte-strided or "
                                         f"page-padded layouts are not dense jax arrays")
        return super().allocate(layout)

    def layout_refusals(self, spec, layout) -> tuple[str, ...]:
        """The layouts the TPU kernels address: the tpu.combined or tpu.hidden form, per
        layer or cross-layer."""
        try:
            CacheFormat.from_layout(layout, spec)
        except KVABIError as e:
            return (str(e).removeprefix(f"{self.name}: unsupported: "),)
        return ()

    # -- the step ------------------------------------------------------------------------
    def prepare(self, plan) -> TPUSteps:
        """The step's device arrays (see :mod:`kvabi_tpu.plan`), rounded to the bucket of
        the limits ``warmup`` declared for the plan's spec and layout, if any."""
        return build_steps(plan, CacheFormat.from_layout(plan.layout, plan.spec),
                           tile_size=self.tile_size, write=self.write_form,
                           num_slices_per_block=self.num_slices_per_block, to_device=to_jax,
                           buckets=self._buckets_of(plan.spec, plan.layout))

    # -- buckets and warm-up -------------------------------------------------------------
    def step_buckets(self, spec, limits) -> StepBuckets:
        """The buckets this backend rounds steps within ``limits`` to (see
        :mod:`kvabi_tpu.step_buckets`)."""
        if not isinstance(spec, kvabi.KVSpec):
            raise KVABIError(f"spec: must be a KVSpec, got {type(spec).__name__}")
        return StepBuckets.build(limits, block_size=spec.block_size, tile_size=self.tile_size,
                                 prefill_rows=getattr(self, "prefill_rows", self.tile_size),
                                 slices_per_block=self.num_slices_per_block)

    def _buckets_of(self, spec, layout):
        for s, l, b in self._declared:
            if s == spec and (l is layout or l == layout):
                return b
        return None

    def warmup(self, spec, layout, limits, *, num_q_heads=None, progress=None) -> None:
        """Declare ``limits`` for ``spec`` over ``layout`` and compile every bucket of them
        (both computations; every layer of a cross-layer layout) ahead of time.

        From then on every plan of this spec and layout is rounded to its bucket and a step
        within the limits never compiles, with queries of ``num_q_heads`` heads (default:
        the KV head count), the spec's default scale and soft cap, queries and new K/V in
        the cache's dtype (any sinks, or none).  A step beyond the limits is refused with a
        KVABIError naming the limit.  ``progress(done, total, what)`` is called after each
        compile.  Nothing is written: the cache planes enter the compiles as shapes only."""
        super().warmup(spec, layout, limits, num_q_heads=num_q_heads, progress=progress)
        buckets = self.step_buckets(spec, limits)
        self.check_supported(spec)
        fmt = CacheFormat.from_layout(layout, spec)
        self._declared = [d for d in self._declared
                          if not (d[0] == spec and d[1] == layout)] + [(spec, layout, buckets)]
        import jax

        from .steps import signature

        hq = spec.num_kv_heads if num_q_heads is None else \
            kvabi.check_num_q_heads(num_q_heads, spec)
        dt = numpy_dtype(layout.dtype)
        planes = tuple(jax.ShapeDtypeStruct(layout.plane_shape, dt)
                       for _ in range(layout.num_planes))
        layers = range(layout.num_layers) if fmt.layer_dim is not None else (0,)
        total, done = 2 * len(buckets.ladder) * len(layers), 0
        for b in buckets.ladder:
            one = kvabi.CommonAttentionMetadata.from_lengths(
                [1], [0], [[0]], spec.block_size, num_blocks=layout.num_blocks)
            plan = self.plan(kvabi.transforms.pad(one, b.tokens, 1), spec, layout,
                             num_q_heads=hq)
            kv = jax.device_put(np.zeros((b.tokens, spec.num_kv_heads, spec.head_dim), dt))
            q = jax.device_put(np.zeros((b.tokens, hq, spec.head_dim), dt))
            for layer in layers:
                idx = fmt.plane_indices(layout, layer)
                for what, (fn, args, kw) in (
                        ("write", self._write_call(plan, tuple(planes[i] for i in idx), kv,
                                                   kv, layer)),
                        ("attend", self._attend_call(plan, q, tuple(planes[i] for i in idx),
                                                        None, layer))):
                    self._compiled[signature(what, args, kw)] = fn.lower(*args, **kw).compile()
                    done += 1
                    if progress is not None:
                        progress(done, total, f"{what}: {b.tokens} tokens, layer {layer}")

    def _layer_planes(self, cache, plan, layer) -> tuple[int, ...]:
        """Indices of ``layer``'s planes in ``cache``; refuses planes consumed by an
        earlier write."""
        steps = plan.prepared
        idx = steps.planes_of_layer.get(layer)
        if idx is None:
            idx = steps.planes_of_layer[layer] = steps.fmt.plane_indices(plan.layout, layer)
        for i in idx:
            if cache[i].is_deleted():
                raise KVABIError(f"cache[{i}]: this jax array was consumed by an earlier "
                                 f"write_kv (its buffer was donated); use the cache that "
                                 f"write_kv returned")
        return idx

    # -- write ---------------------------------------------------------------------------
    def write(self, plan, cache, key, value, layer):
        """New K/V [T, H, D] into the slots of ``plan`` (slot -1 skipped) of ``layer``.

        The cache is *consumed*: its planes holding ``layer`` are donated to the jitted
        update, which writes them in place, so a write costs the tokens written, not the
        cache size.  The returned handle holds the new planes; the argument's planes of
        this layer are deleted.  (``donate_cache=False`` at construction keeps them,
        copying instead.)"""
        idx = self._layer_planes(cache, plan, layer)
        if plan.meta.num_tokens == 0:
            return cache
        if len({id(cache[i]) for i in idx}) < len(idx):
            raise KVABIError(f"cache: planes {list(idx)} of layer {layer} are one array; "
                             f"each plane needs its own memory")
        from .steps import run

        fn, args, kw = self._write_call(plan, tuple(cache[i] for i in idx), key, value, layer)
        return cache.replace_planes(dict(zip(idx, run(self._compiled, "write", fn, args, kw))))

    # -- attention -----------------------------------------------------------------------
    def attend(self, plan, cache, query, layer, sinks, out, return_lse):
        """Attention of ``query`` [T, Hq, D] over ``layer``: output [T, Hq, D] in the
        query's dtype and lse [T, Hq] float32.  ``sinks`` enter as a traced array, so
        layers with different sinks share one compiled step.  jax cannot write into an
        existing array: the result is returned, never written into ``out``."""
        import jax.numpy as jnp

        t, hq, d = plan.meta.num_tokens, plan.num_q_heads, plan.spec.head_dim
        idx = self._layer_planes(cache, plan, layer)
        if t == 0:
            return jnp.zeros((0, hq, d), query.dtype), jnp.zeros((0, hq), jnp.float32)
        fn, args, kw = self._attend_call(plan, query, tuple(cache[i] for i in idx),
                                         self._device_sinks(plan, sinks), layer)
        from .steps import run

        res, lse = run(self._compiled, "attend", fn, args, kw)
        if plan.prepared.bucket is not None:
            res, lse = first_rows(res, t), first_rows(lse, t)
        return res, lse

    def _write_call(self, plan, planes, key, value, layer):
        """(jitted write step, positional args, keywords) of one layer's write."""
        from .steps import compiled  # jax is imported on first use only

        steps = plan.prepared
        impl, args, static = self._write_impl(plan)
        if steps.bucket is not None:  # the step's rows at their bucket: the bucket's key
            key, value = pad_rows(key, steps.padded_tokens), pad_rows(value, steps.padded_tokens)
        return compiled("write", donate=self.donate_cache, cheap=self._cheap_compile()), (
            planes, key, value, args), dict(fmt=steps.fmt, layer=_static_layer(steps.fmt, layer),
                                            padded_tokens=steps.padded_tokens, impl=impl,
                                            static=static)

    def _attend_call(self, plan, query, planes, sink, layer):
        """(jitted attention step, positional args, keywords) of one layer's attention;
        ``sink`` the device sinks of the call or None."""
        from .steps import compiled

        hq, steps = query.shape[1], plan.prepared
        impl, args, static = self._attend_impl(plan)
        if steps.bucket is not None:
            # one compiled step whatever the sinks: "no sinks" is sinks of -inf
            query = pad_rows(query, steps.padded_tokens)
            sink = _no_sinks(hq) if sink is None else sink
        static = static + (("scale", plan.scale), ("softcap", plan.softcap),
                           ("kind", plan.spec.kind), ("window", steps.window),
                           ("chunk", steps.chunk), ("has_sinks", sink is not None))
        return compiled("attend", donate=False, cheap=self._cheap_compile()), (
            query, planes, args, _zero_sinks(hq) if sink is None else sink), dict(
            fmt=steps.fmt, layer=_static_layer(steps.fmt, layer),
            padded_tokens=steps.padded_tokens, impl=impl, static=tuple(sorted(static)))

    def _device_sinks(self, plan, sinks):
        """``sinks`` (checked float64, or None) on the device as float32: the plan's are
        there already; a layer's, once per array (the base class hands the same checked
        array for the same sinks tensor)."""
        if sinks is None or sinks is plan.sinks:
            return plan.prepared.sinks_device
        if "_sinks_on_device" not in self.__dict__:
            self._sinks_on_device = ConvertOnce("jax", dtype="float32")
        return self._sinks_on_device(sinks)

    # -- the computations ----------------------------------------------------------------
    def _cheap_compile(self) -> bool:
        """Whether steps compile with cheap XLA options (see :attr:`fast_compile`)."""
        return self.fast_compile

    def _write_impl(self, plan):
        """(update function, its device arrays, its static keywords as sorted pairs) for a
        write: ``update(rows, page_planes, *arrays, **static) -> new page planes``."""
        raise NotImplementedError

    def _attend_impl(self, plan):
        """(attention function, its device arrays, its static keywords as pairs):
        ``attend(query, planes, *arrays, sinks, fmt=, **static) -> (out, lse)``."""
        raise NotImplementedError


def _static_layer(fmt, layer) -> int:
    """The layer as the jitted steps see it: only cross-layer planes are sliced by layer,
    so every other layout passes 0 and all its layers share one compiled step."""
    return int(layer) if fmt.layer_dim is not None else 0


@functools.lru_cache(maxsize=None)
def _zero_sinks(hq: int):
    import jax

    return jax.device_put(np.zeros(hq, np.float32))


@functools.lru_cache(maxsize=None)
def _no_sinks(hq: int):
    import jax

    return jax.device_put(np.full(hq, -np.inf, np.float32))
