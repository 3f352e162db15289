"""The base class of every attention backend: it owns the boundary.

An engine calls three methods (FlashInfer's split: a plan once per step and KV group, then
per layer a write and an attention with that plan):

- ``plan(meta, spec, layout, *, num_q_heads, scale=None, softcap=None, sinks=None)`` gives
  a :class:`kvabi.StepPlan`, which fixes the layout;
- ``write_kv(plan, cache, *, key, value=None, layer=0, k_scale=None, v_scale=None)``
  gives the cache;
- ``attention(plan, cache, *, query, layer=0, sinks=None, out=None, return_lse=False,
  k_scale=None, v_scale=None)``.

``k_scale``/``v_scale`` are the layer's static scales of a ``per_tensor`` quantized cache
(``specs/semantics.md`` section 11) and are refused for any other cache.

:class:`Backend` runs every public check of these calls, once and in one place: the backend
is available and claims the spec, the layout and the options; the step fits the layout;
the plan is one this backend made; the cache is a :class:`kvabi.KVCache` of the plan's
layout in the backend's framework; key, value and query have the step's shapes and real
dtypes (converted into the backend's framework and device where they are not); per-call
sinks; the ``out=`` buffer (shape, dtype, no byte shared with the query or the cache);
static scales.
Then it calls the backend's own small methods, by keyword, with checked arguments:

- ``prepare(plan)``: what the backend precomputes for the step (index arrays on its
  device, a library's planned wrapper), attached to the plan as ``plan.prepared``;
- ``write(plan, cache, key, value, layer)``: the new K/V into the cache; returns the cache;
- ``attend(plan, cache, query, layer, sinks, out, return_lse)``: ``(output, lse or None)``;
- for a ``per_tensor`` spec only (a backend that claims it in ``Capabilities.quant``), both
  also get ``scales``: the checked ``(k_scale, v_scale)`` as float32 values.

A backend author writes those three (and describes the backend: ``available``,
``capabilities``, ``preferred_layouts``, optionally ``layout_refusals``, ``device``,
``allocate``, ``warmup``); every backend gets the same refusals with the same messages.
"""
from __future__ import annotations

import weakref
from typing import Any, Literal, overload

from ..layout.check import check_layer
from ..memory.cache import KVCache
from ..model.quant import check_scales
from ..model.spec import KVSpec
from ..step.checks import (AttentionOptions, check_kv, check_num_q_heads, check_out, check_query,
                           check_sinks, check_step, dtype_class, real_dtype)
from ..step.plan import StepPlan
from ..util.coerce import as_bool, real_array
from ..util.errors import KVABIError, UnsupportedError
from ..util.tensors import convert, framework
from ..util.version import ABI_VERSION
from .capabilities import Capabilities

#: the methods the base class runs; a backend implements prepare/write/attend instead
BOUNDARY = ("plan", "write_kv", "attention", "refusals", "check_supported")

# plan -> the backend that made it: a copy or a rebuilt plan is in no backend's table
_ISSUED: "weakref.WeakKeyDictionary[StepPlan, Backend]" = weakref.WeakKeyDictionary()


class Backend:
    """Base class of an attention backend (see the module docstring).

    Arrays cross in the backend's framework (:attr:`framework`: numpy, torch or jax):
    ``key`` [T, H, D], ``value`` [T, H, Dv] (None for MLA, whose latent is ``key``
    [T, 1, D]), ``query`` [T, Hq, D] floating point; the output [T, Hq, Dv] has the
    query's dtype, lse [T, Hq] is float32 (natural log; the numpy reference gives float64
    for both).  ``T`` is ``meta.num_tokens`` (padding included); outputs at padding tokens
    are unspecified.  A plan holds no layer state: one serves every layer of its KV group.
    """

    #: dotted name, e.g. "cuda.triton"
    name: str = ""
    #: the ABI (major, minor) the backend was built for
    abi_version: tuple[int, int] = ABI_VERSION
    #: the framework of the backend's arrays: "numpy", "torch" or "jax"
    framework: str = "numpy"

    # -- what the backend says about itself ----------------------------------------------
    def available(self) -> tuple[bool, str]:
        """(usable here, reason or mode description)."""
        return True, ""

    def capabilities(self, spec=None) -> Capabilities:
        raise NotImplementedError

    def preferred_layouts(self, spec) -> tuple[str, ...]:
        """Layout preset names, best first."""
        raise NotImplementedError

    def layout_refusals(self, spec, layout) -> tuple[str, ...]:
        """Why the backend cannot serve ``spec`` over ``layout`` (a layout that holds the
        spec), every reason; empty when it can.  The base class claims every layout."""
        return ()

    def device(self):
        """The device arrays are placed on (None: the framework's default)."""
        return None

    def allocate(self, layout) -> KVCache:
        """A zeroed :class:`kvabi.KVCache` for ``layout`` in this backend's framework."""
        return KVCache.allocate(layout, self.framework, device=self.device())

    def warmup(self, spec, layout, limits, *, num_q_heads=None, progress=None) -> None:
        """Prepare every step within ``limits`` (a :class:`kvabi.StepLimits`) for ``spec``
        over ``layout`` ahead of time, so that no step within them pays a compile.

        A backend that compiles per shape builds all its buckets here and states what a
        step outside the limits does (refused or compiled once); ``progress``, when given,
        is called as ``progress(done, total, what)`` after each piece.  The base class has
        nothing to prepare: it checks its arguments and returns."""
        from ..step.limits import StepLimits

        if not isinstance(limits, StepLimits):
            raise KVABIError(f"limits: must be a kvabi.StepLimits, got {type(limits).__name__}")

    # -- the backend's kernel glue -------------------------------------------------------
    def prepare(self, plan: StepPlan) -> Any:
        """What the backend precomputes for the step ``plan`` (checked; its ``prepared`` is
        None): returned, it becomes ``plan.prepared``.  Nothing here may depend on the
        layer.  The base class prepares nothing."""
        return None

    def write(self, plan: StepPlan, cache: KVCache, key, value, layer: int) -> KVCache:
        """Write ``key``/``value`` (checked, in the framework) at the plan's slot mapping
        (slot -1 skipped) into ``layer`` of ``cache`` (a checked handle of the plan's
        layout); returns the cache (numpy, torch: in place; jax: a new handle)."""
        raise NotImplementedError

    def attend(self, plan: StepPlan, cache: KVCache, query, layer: int, sinks, out,
               return_lse: bool) -> tuple[Any, Any]:
        """``(output, lse)`` of ``query`` over ``layer`` of ``cache``; lse None unless
        ``return_lse``.  ``sinks``: float64 numpy [Hq] or None (this call's, else the
        plan's).  ``out``: a checked buffer or None; write the output there where the
        framework allows (the base class copies it there otherwise)."""
        raise NotImplementedError

    # -- the boundary: run by the base class, never overridden ---------------------------
    def refusals(self, spec, layout=None, *, softcap=None, sinks=None) -> tuple[str, ...]:
        """Every reason this backend cannot serve ``spec`` (with a soft cap / sinks, when
        given; over ``layout``, when given): unavailable here, outside its capabilities,
        a layout it cannot address.  Empty when it can."""
        if not isinstance(spec, KVSpec):
            raise KVABIError(f"spec: must be a KVSpec, got {type(spec).__name__}")
        memo = self.__dict__.setdefault("_kvabi_refusals", {})
        key = (spec, softcap is not None, sinks is not None)
        why = memo.get(key)
        if why is None:  # capabilities may be costly to build: once per spec and options
            ok, reason = self.available()
            why = (() if ok else (f"unavailable: {reason}",)) + tuple(
                self.capabilities(spec).refusals(spec, softcap=softcap, sinks=sinks))
            if len(memo) >= 256:
                memo.clear()
            memo[key] = why
        if layout is not None and not why:
            why = tuple(self.layout_refusals(spec, layout))
        return why

    def check_supported(self, spec, layout=None, *, softcap=None, sinks=None) -> None:
        """:class:`kvabi.UnsupportedError` listing every reason of :meth:`refusals`."""
        why = self.refusals(spec, layout, softcap=softcap, sinks=sinks)
        if why:
            raise UnsupportedError(f"{self.name}: unsupported: {'; '.join(why)}")

    def plan(self, meta, spec, layout, *, num_q_heads, scale=None, softcap=None,
             sinks=None) -> StepPlan:
        """The step's :class:`kvabi.StepPlan` (once per step and KV group): the step checked
        against the layout, the backend's refusals, the options resolved, then the
        backend's :meth:`prepare`.  ``num_q_heads``: the query heads of every layer of the
        group (a positive multiple of the KV heads); ``sinks``: the default of every layer
        (``attention(sinks=)`` overrides it per layer)."""
        check_step(meta, spec, layout)
        self.check_supported(spec, layout, softcap=softcap, sinks=sinks)
        hq = check_num_q_heads(num_q_heads, spec)
        opts = AttentionOptions.resolve(spec, scale, softcap, sinks, num_q_heads=hq)
        plan = StepPlan(self.name, meta, spec, layout, hq, opts.scale, opts.softcap,
                        opts.sinks)
        # set once, before anyone else holds the plan (prepare sees prepared=None)
        object.__setattr__(plan, "prepared", self.prepare(plan=plan))
        _ISSUED[plan] = self
        return plan

    def write_kv(self, plan: StepPlan, cache: KVCache, *, key, value=None,
                 layer: int = 0, k_scale=None, v_scale=None) -> KVCache:
        """Write the step's new K/V into ``layer`` of ``cache`` at the plan's slots (slot
        -1 skipped); returns the cache.  numpy and torch caches are written in place; a
        jax cache is consumed (its buffers donated to the update): use the returned one.
        ``k_scale``/``v_scale``: the layer's static scales of a ``per_tensor`` cache (1.0
        when not given)."""
        cache = self.__cache(plan, cache)
        scales = check_scales(plan.spec, k_scale, v_scale)
        if type(layer) is not int or not 0 <= layer < plan.num_layers:
            layer = check_layer(layer, plan.layout)
        key = self.__array(key, "key")
        value = None if value is None else self.__array(value, "value")
        kshape, vshape = plan.shapes[:2]
        if key.shape != kshape or (None if value is None else value.shape) != vshape:
            check_kv(key, value, plan.meta, plan.spec)  # names what is wrong
        if scales is not None:
            return self.write(plan=plan, cache=cache, key=key, value=value, layer=layer,
                              scales=scales)
        return self.write(plan=plan, cache=cache, key=key, value=value, layer=layer)

    @overload
    def attention(self, plan: StepPlan, cache: KVCache, *, query, layer: int = 0,
                  sinks=None, out=None, return_lse: Literal[False] = False, k_scale=None,
                  v_scale=None) -> Any: ...

    @overload
    def attention(self, plan: StepPlan, cache: KVCache, *, query, layer: int = 0,
                  sinks=None, out=None, return_lse: Literal[True], k_scale=None,
                  v_scale=None) -> tuple[Any, Any]: ...

    def attention(self, plan, cache, *, query, layer=0, sinks=None, out=None,
                  return_lse=False, k_scale=None, v_scale=None):
        """Attention of the step's ``query`` over ``layer`` of ``cache``: the output, or
        ``(output, lse)`` with ``return_lse``.  ``sinks`` ([Hq] logits) override the
        plan's for this call; ``out`` ([T, Hq, Dv], the query's dtype, sharing no memory
        with the query or the cache) receives the output in place where the framework
        allows (numpy, torch) and is returned (jax: a new array is returned).
        ``k_scale``/``v_scale``: as for :meth:`write_kv`."""
        cache = self.__cache(plan, cache)
        scales = check_scales(plan.spec, k_scale, v_scale)
        if type(layer) is not int or not 0 <= layer < plan.num_layers:
            layer = check_layer(layer, plan.layout)
        if return_lse is not False and return_lse is not True:
            return_lse = as_bool(return_lse, "return_lse")
        query = self.__array(query, "query")
        if query.shape != plan.shapes[2] or dtype_class(query.dtype) != "float":
            hq = check_query(query, plan.meta, plan.spec)  # names what is wrong
            raise KVABIError(f"query: the plan was made for num_q_heads={plan.num_q_heads}, "
                             f"got {hq} query heads")
        hq = plan.num_q_heads
        if sinks is None:
            sinks = plan.sinks
        else:
            self.check_supported(plan.spec, sinks=sinks)  # a backend without sinks
            sinks = self.__sinks(sinks, hq)
        if out is not None:
            check_out(out, plan.shapes[3], query, self.framework,
                      () if self.framework == "jax" else cache.layer_spans(layer))
        kw = {} if scales is None else {"scales": scales}
        res, lse = self.attend(plan=plan, cache=cache, query=query, layer=layer, sinks=sinks,
                               out=out, return_lse=return_lse, **kw)
        if out is not None and res is not out and self.framework != "jax":
            if self.framework == "torch":
                out.copy_(res)
            else:
                out[...] = res
            res = out
        return (res, lse) if return_lse else res

    # -- the checks behind them ----------------------------------------------------------
    def __cache(self, plan, cache) -> KVCache:
        """``plan`` is one this backend made; ``cache`` a handle of its layout, of this
        backend's framework and kind of device.  The last plan that passed is remembered
        (held, so its address cannot be reused; a plan is small): every layer of a step
        passes the same one.  The cache is not held (it may be all of a device's memory)."""
        if plan is not self.__dict__.get("_kvabi_plan"):
            if type(plan) is not StepPlan or _ISSUED.get(plan) is not self:
                got = type(plan).__name__ if type(plan) is not StepPlan else \
                    f"a plan of {plan.backend!r} not made by this backend object"
                raise KVABIError(f"plan: must come from {self.name}.plan(), got {got}")
            self.__dict__["_kvabi_plan"] = plan
        if type(cache) is not KVCache:
            raise KVABIError(f"cache: must be a kvabi.KVCache (KVCache.wrap(layout, planes) "
                             f"checks planes once), got {type(cache).__name__}")
        if cache.layout is not plan.layout and cache.layout != plan.layout:
            raise KVABIError(f"cache: its layout ({_describe(cache.layout)}) is not the "
                             f"plan's ({_describe(plan.layout)}); plan each layout's steps "
                             f"with that layout")
        if cache.framework != self.framework:
            raise KVABIError(f"cache: {self.name} takes {self.framework} planes, got a cache "
                             f"of {cache.framework} planes (kvabi.tensors.convert copies "
                             f"them)")
        dev = self.__device()
        if dev is not None and self.framework == "torch" and len(cache) and \
                cache[0].device.type != dev.type:
            raise KVABIError(f"cache: planes are on {cache[0].device}, {self.name} runs on "
                             f"{dev}")
        return cache

    def __device(self):
        """:meth:`device`, asked once."""
        try:
            return self.__dict__["_kvabi_device"]
        except KeyError:
            dev = self.__dict__["_kvabi_device"] = self.device()
            return dev

    def __array(self, x, field: str):
        """``x`` (real numbers) in this backend's framework, on its device."""
        fw = framework(x)
        if fw != self.framework:
            if fw is None:
                x = real_array(x, field)
            x = convert(x, self.framework, device=self.__device())
        elif fw == "torch":
            dev = self.__device()
            if dev is not None and x.device.type != dev.type:
                x = x.to(dev)
        if dtype_class(x.dtype) == "other":
            real_dtype(x, field)
        return x

    def __sinks(self, sinks, hq: int):
        """Per-call sinks, checked; a torch or jax tensor once per tensor (and per in-place
        change): an engine passes each layer's learned sinks, the same tensor every step,
        and checking a device tensor costs a host copy."""
        fw = framework(sinks)
        if fw not in ("torch", "jax"):
            return check_sinks(sinks, hq)
        memo = self.__dict__.setdefault("_kvabi_sinks", {})
        version = getattr(sinks, "_version", None)
        hit = memo.get(id(sinks))
        if hit is not None and hit[0]() is sinks and hit[1] == version and \
                hit[2].shape == (hq,):
            return hit[2]
        a = check_sinks(sinks, hq)
        try:
            ref = weakref.ref(sinks)
        except TypeError:
            return a
        if len(memo) >= 4096:
            memo.clear()
        memo[id(sinks)] = (ref, version, a)
        return a


def _describe(layout) -> str:
    return f"{layout.name or 'custom'} of {layout.num_blocks} blocks and " \
           f"{layout.num_layers} layers"
