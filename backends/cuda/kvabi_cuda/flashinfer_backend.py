"""The ``cuda.flashinfer`` backend: an adapter onto FlashInfer's paged-KV API.

Writes go through ``append_paged_kv_cache``; attention through
``BatchDecodeWithPagedKVCacheWrapper`` (every request one query token, no sinks) or
``BatchPrefillWithPagedKVCacheWrapper`` (mixed batches, sinks).  FlashInfer's ``plan``
needs the query head count: given ``num_q_heads`` (ABI 1.1), kvabi's ``plan`` plans the
wrapper itself; without it (1.0 callers) the wrapper is planned at the first attention call
of the step and reused by every other layer.  Per-layer sinks given to ``attention`` need
the prefill wrapper: a plan whose wrapper is the decode one plans a prefill wrapper for
them once, on first use.  All argument translation lives in the pure
:func:`kvabi_cuda.flashinfer_args.flashinfer_args`.
"""
from __future__ import annotations

import inspect

import attrs
import numpy as np

from kvabi import UnsupportedError, check_kv, check_step
from kvabi.tensors import to_torch, torch_dtype

from . import boundary
from .flashinfer_args import append_args, flashinfer_args, paged_kv_tensors
from .layouts import nhd_or_hnd
from .library_backend import LibraryBackend

#: FlashInfer's float workspace (its own examples use 128 MiB)
WORKSPACE_BYTES = 128 << 20


@attrs.define(eq=False)
class FlashInferPlan:
    meta: object
    spec: object
    layout: object
    opts: object  # AttentionOptions
    kv_layout: str
    num_q_heads: int | None
    torch_dtype: object
    #: ``append_paged_kv_cache``'s index tensors on the device, built once per step
    append: dict
    #: (num_qo_heads, wrapper for per-call sinks) -> (translated args, planned wrapper,
    #: run kwargs as tensors)
    planned: dict = attrs.field(factory=dict)


class FlashInferBackend(LibraryBackend):
    """FlashInfer's paged prefill/decode wrappers and append kernel behind kvabi's ABI."""

    name = "cuda.flashinfer"
    module = "flashinfer"
    extra = "flashinfer"
    first_layouts = ("flashinfer.NHD", "flashinfer.HND")

    def __init__(self, library=None, device=None):
        super().__init__(library, device)
        self._workspace = None
        self._sinks_ok = None

    def base_capabilities(self) -> dict:
        return dict(kinds=("full", "sliding_window", "chunked_local"),
                    dtypes=("float16", "bfloat16"), head_dims=(64, 128, 256),
                    block_sizes=None, softcap=True, sinks=self._run_takes_sinks(),
                    notes="FlashInfer paged API; K and V views need equal strides, D "
                          "contiguous; chunked local via kvabi's virtual batches (chunk a "
                          "multiple of block_size); sinks where the installed FlashInfer's "
                          "run() takes them")

    def _run_takes_sinks(self) -> bool:
        if self._sinks_ok is None:
            self._sinks_ok = _takes_sinks(self.lib)
        return self._sinks_ok

    # -- plan --------------------------------------------------------------------------
    def plan(self, meta, spec, layout, *, num_q_heads=None, scale=None, softcap=None,
             sinks=None):
        self._require_available()
        check_step(meta, spec, layout)
        self.check_supported(spec, softcap=softcap, sinks=sinks)
        self.check_layout(layout, spec)
        opts, hq = boundary.plan_options(spec, num_q_heads, scale, softcap, sinks)
        kv_layout = nhd_or_hnd(layout)
        dev = self.device()
        append = {k: to_torch(v, dev) if isinstance(v, np.ndarray) else v
                  for k, v in append_args(meta, spec, kv_layout).items()}
        plan = FlashInferPlan(meta, spec, layout, opts, kv_layout, hq,
                              torch_dtype(spec.dtype), append)
        if hq is not None:  # FlashInfer's plan, at kvabi's plan time
            self._planned(plan, hq, False)
        return plan

    def _planned(self, plan, hq: int, call_sinks: bool):
        """The wrapper planned for ``hq`` query heads (and for per-call sinks: the prefill
        wrapper), translated and planned once per step."""
        key = (hq, call_sinks)
        hit = plan.planned.get(key)
        if hit is not None:
            return hit
        if call_sinks and (hq, False) in plan.planned and \
                plan.planned[(hq, False)][0]["wrapper"] == "prefill":
            hit = plan.planned[key] = plan.planned[(hq, False)]
            return hit
        import torch

        spec, opts = plan.spec, plan.opts
        # Per-call sinks: plan as if sinks were given (zeros stand in; run gets the real ones).
        sinks = opts.sinks if not call_sinks or opts.sinks is not None else np.zeros(hq)
        args = flashinfer_args(plan.meta, spec, plan.kv_layout, num_qo_heads=hq,
                               scale=opts.scale, softcap=opts.softcap, sinks=sinks)
        lib, dev = self.lib(), self.device()
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        cls = (lib.BatchDecodeWithPagedKVCacheWrapper if args["wrapper"] == "decode"
               else lib.BatchPrefillWithPagedKVCacheWrapper)
        wrapper = cls(self._workspace, args["kv_layout"])
        dt = plan.torch_dtype
        # Index arrays stay on the host for plan (FlashInfer copies them itself).
        kw = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
              for k, v in args["plan"].items()}
        wrapper.plan(**kw, q_data_type=dt, kv_data_type=dt)
        run = {k: to_torch(v, dev) if isinstance(v, np.ndarray) else v
               for k, v in args["run"].items()}
        plan.planned[key] = (args, wrapper, run)
        return plan.planned[key]

    # -- write -------------------------------------------------------------------------
    def write_kv(self, cache, layout, key, value, plan, *, layer: int = 0):
        c = self.cache(cache, layout, plan, FlashInferPlan)
        spec, meta = plan.spec, plan.meta
        check_kv(key, value, meta, spec)
        a = meta.num_actual_tokens
        if a == 0:
            return cache
        dev, dt = self.device(), plan.torch_dtype
        # append_paged_kv_cache takes exactly the real tokens, in the cache dtype.
        key = to_torch(key, dev)[:a].to(dt)
        value = to_torch(value, dev)[:a].to(dt)
        k_view, v_view = c.kv_view(layer, 0), c.kv_view(layer, 1)
        pair = paged_kv_tensors(k_view, v_view, plan.kv_layout)
        t = plan.append
        self.lib().append_paged_kv_cache(key, value, t["batch_indices"], t["positions"], pair,
                                         t["kv_indices"], t["kv_indptr"],
                                         t["kv_last_page_len"], kv_layout=t["kv_layout"])
        return cache

    # -- attention ---------------------------------------------------------------------
    def attention(self, query, cache, layout, plan, *, layer: int = 0, sinks=None, out=None,
                  return_lse=False):
        c = self.cache(cache, layout, plan, FlashInferPlan)
        spec = plan.spec
        hq = boundary.query_heads(query, plan)
        if sinks is None:
            plan.opts.check_heads(hq)
            args, wrapper, run = self._planned(plan, hq, False)
        else:
            if not self._run_takes_sinks():
                raise UnsupportedError(f"{self.name}: unsupported: attention sinks not "
                                       "supported")
            args, wrapper, run = self._planned(plan, hq, True)
            run = dict(run, sinks=self._sinks.get(sinks, hq, self.device()))
        q, k_view, v_view, o, lse = self.step_tensors(query, c, plan, layer, hq, out,
                                                      return_lse)
        a = args["num_actual_tokens"]
        if a:
            res, l2 = wrapper.run(q[:a], paged_kv_tensors(k_view, v_view, plan.kv_layout),
                                  **run)
            o[:a] = res
            if lse is not None:
                lse[:a] = l2.float() * args["lse_scale"]
        return (o, lse) if return_lse else o


def _takes_sinks(lib) -> bool:
    """Whether the installed FlashInfer's prefill ``run`` takes ``sinks``."""
    try:
        run = lib().BatchPrefillWithPagedKVCacheWrapper.run
    except Exception:  # noqa: BLE001 - not installed: no sinks
        return False
    try:
        return "sinks" in inspect.signature(run).parameters
    except (TypeError, ValueError):
        return False
