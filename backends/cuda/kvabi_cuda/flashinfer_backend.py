"""The ``cuda.flashinfer`` backend: an adapter onto FlashInfer's paged-KV API.

Writes go through ``append_paged_kv_cache``; attention through
``BatchDecodeWithPagedKVCacheWrapper`` (every request one query token) or
``BatchPrefillWithPagedKVCacheWrapper`` (mixed batches).  FlashInfer needs the query head
count at ``plan`` time, which kvabi's plan does not know: the wrapper is planned at the
first layer's attention call of the step, then reused by every other layer.  All argument
translation lives in the pure :func:`kvabi_cuda.flashinfer_args.flashinfer_args`.
"""
from __future__ import annotations

import inspect

import attrs
import numpy as np

from . import tensors
from .flashinfer_args import append_args, flashinfer_args, paged_kv_tensors
from .layouts import nhd_or_hnd
from .library_backend import LibraryBackend
from kvabi import AttentionOptions, check_kv, check_query, check_step

#: FlashInfer's float workspace (its own examples use 128 MiB)
WORKSPACE_BYTES = 128 << 20


@attrs.define(eq=False)
class FlashInferPlan:
    meta: object
    spec: object
    layout: object
    opts: AttentionOptions
    kv_layout: str
    #: num_qo_heads -> (translated args, planned wrapper, run kwargs as tensors)
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

    def base_capabilities(self) -> dict:
        return dict(kinds=("full", "sliding_window", "chunked_local"),
                    dtypes=("float16", "bfloat16"), head_dims=(64, 128, 256),
                    block_sizes=None, softcap=True, sinks=self._run_takes_sinks(),
                    notes="FlashInfer paged API; K and V views need equal strides, D "
                          "contiguous; chunked local via kvabi's virtual batches (chunk a "
                          "multiple of block_size); sinks where the installed FlashInfer's "
                          "run() takes them")

    def _run_takes_sinks(self) -> bool:
        try:
            run = self.lib().BatchPrefillWithPagedKVCacheWrapper.run
        except Exception:  # noqa: BLE001 - not installed: no sinks
            return False
        try:
            return "sinks" in inspect.signature(run).parameters
        except (TypeError, ValueError):
            return False

    # -- plan --------------------------------------------------------------------------
    def plan(self, meta, spec, layout, *, scale=None, softcap=None, sinks=None):
        self._require_available()
        check_step(meta, spec, layout)
        self.check_supported(spec, softcap=softcap, sinks=sinks)
        opts = AttentionOptions.resolve(spec, scale, softcap, sinks)
        return FlashInferPlan(meta, spec, layout, opts, nhd_or_hnd(layout))

    def _planned(self, plan, hq: int):
        """Translate and plan the wrapper for ``hq`` query heads, once per step."""
        if hq in plan.planned:
            return plan.planned[hq]
        import torch

        spec, opts = plan.spec, plan.opts
        args = flashinfer_args(plan.meta, spec, plan.kv_layout, num_qo_heads=hq,
                               scale=opts.scale, softcap=opts.softcap, sinks=opts.sinks)
        lib, dev = self.lib(), self.device()
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        cls = (lib.BatchDecodeWithPagedKVCacheWrapper if args["wrapper"] == "decode"
               else lib.BatchPrefillWithPagedKVCacheWrapper)
        wrapper = cls(self._workspace, args["kv_layout"])
        dt = tensors.torch_dtype(spec.dtype)
        # Index arrays stay on the host for plan (FlashInfer copies them itself).
        kw = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
              for k, v in args["plan"].items()}
        wrapper.plan(**kw, q_data_type=dt, kv_data_type=dt)
        run = {k: tensors.to_torch(v, dev) if isinstance(v, np.ndarray) else v
               for k, v in args["run"].items()}
        plan.planned[hq] = (args, wrapper, run)
        return plan.planned[hq]

    # -- write -------------------------------------------------------------------------
    def write_kv(self, cache, layout, key, value, plan, *, layer: int = 0):
        self.check_plan(plan, layout, FlashInferPlan)
        spec, meta = plan.spec, plan.meta
        check_kv(key, value, meta, spec)
        a = meta.num_actual_tokens
        if a == 0:
            return cache
        dev = self.device()
        dt = spec.dtype
        # append_paged_kv_cache takes exactly the real tokens, in the cache dtype.
        key = tensors.to_torch(key, dev, dt)[:a]
        value = tensors.to_torch(value, dev, dt)[:a]
        k_view, v_view = self.views(layout, cache, layer, spec)
        pair = paged_kv_tensors(k_view, v_view, plan.kv_layout)
        ap = append_args(meta, spec, plan.kv_layout)
        t = {k: tensors.to_torch(v, dev) if isinstance(v, np.ndarray) else v
             for k, v in ap.items()}
        self.lib().append_paged_kv_cache(key, value, t["batch_indices"], t["positions"], pair,
                                         t["kv_indices"], t["kv_indptr"],
                                         t["kv_last_page_len"], kv_layout=t["kv_layout"])
        return cache

    # -- attention ---------------------------------------------------------------------
    def attention(self, query, cache, layout, plan, *, layer: int = 0, return_lse=False):
        self.check_plan(plan, layout, FlashInferPlan)
        spec, meta = plan.spec, plan.meta
        hq = check_query(query, meta, spec)
        plan.opts.check_heads(hq)
        args, wrapper, run = self._planned(plan, hq)
        q, k_view, v_view, out, lse = self.step_tensors(query, cache, layout, plan, layer, hq)
        a = args["num_actual_tokens"]
        if a:
            o, l2 = wrapper.run(q[:a], paged_kv_tensors(k_view, v_view, plan.kv_layout), **run)
            out[:a] = o.to(out.dtype)
            lse[:a] = l2.float() * args["lse_scale"]
        return (out, lse) if return_lse else out
