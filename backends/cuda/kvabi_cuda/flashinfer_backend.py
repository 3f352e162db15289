"""The ``cuda.flashinfer`` backend: an adapter onto FlashInfer's paged-KV API.

Writes go through ``append_paged_kv_cache``; attention through
``BatchDecodeWithPagedKVCacheWrapper`` (every request one query token, no sinks) or
``BatchPrefillWithPagedKVCacheWrapper`` (mixed batches, sinks).  FlashInfer's ``plan``
needs the query head count, which kvabi's plan carries: the wrapper is planned in
``prepare``.  Per-layer sinks given to ``attention`` need the prefill wrapper: a plan whose
wrapper is the decode one plans a prefill wrapper for them once, on first use.  All
argument translation lives in the pure :func:`kvabi_cuda.flashinfer_args.flashinfer_args`.
"""
from __future__ import annotations

import inspect

import attrs
import numpy as np

from kvabi.util.tensors import to_torch, torch_dtype

from .flashinfer_args import append_args, flashinfer_args, paged_kv_tensors
from .layouts import nhd_or_hnd
from .library_backend import LibraryBackend

#: FlashInfer's float workspace (its own examples use 128 MiB)
WORKSPACE_BYTES = 128 << 20


@attrs.frozen(eq=False)
class FlashInferSteps:
    """What the FlashInfer adapter prepares for a step."""

    kv_layout: str
    torch_dtype: object
    #: ``append_paged_kv_cache``'s index tensors on the device, built once per step
    append: dict
    #: wrapper for per-call sinks? -> (translated args, planned wrapper, run kwargs as
    #: tensors); the plan's own in ``prepare``, the one for per-call sinks on first use
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

    # -- once per step -----------------------------------------------------------------
    def prepare(self, plan) -> FlashInferSteps:
        kv_layout = nhd_or_hnd(plan.layout)
        dev = self.device()
        append = {k: to_torch(v, dev) if isinstance(v, np.ndarray) else v
                  for k, v in append_args(plan.meta, plan.spec, kv_layout).items()}
        steps = FlashInferSteps(kv_layout, torch_dtype(plan.spec.dtype), append)
        self._planned(plan, steps, False)  # FlashInfer's plan, at kvabi's plan time
        return steps

    def _planned(self, plan, steps, call_sinks: bool):
        """The wrapper planned for the step (and for per-call sinks: the prefill wrapper),
        translated and planned once per step."""
        hit = steps.planned.get(call_sinks)
        if hit is not None:
            return hit
        if call_sinks and steps.planned[False][0]["wrapper"] == "prefill":
            hit = steps.planned[True] = steps.planned[False]
            return hit
        import torch

        spec, hq = plan.spec, plan.num_q_heads
        # Per-call sinks: plan as if sinks were given (zeros stand in; run gets the real ones).
        sinks = plan.sinks if not call_sinks or plan.sinks is not None else np.zeros(hq)
        args = flashinfer_args(plan.meta, spec, steps.kv_layout, num_qo_heads=hq,
                               scale=plan.scale, softcap=plan.softcap, sinks=sinks)
        lib, dev = self.lib(), self.device()
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        cls = (lib.BatchDecodeWithPagedKVCacheWrapper if args["wrapper"] == "decode"
               else lib.BatchPrefillWithPagedKVCacheWrapper)
        wrapper = cls(self._workspace, args["kv_layout"])
        dt = steps.torch_dtype
        # Index arrays stay on the host for plan (FlashInfer copies them itself).
        kw = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v
              for k, v in args["plan"].items()}
        wrapper.plan(**kw, q_data_type=dt, kv_data_type=dt)
        run = {k: to_torch(v, dev) if isinstance(v, np.ndarray) else v
               for k, v in args["run"].items()}
        steps.planned[call_sinks] = (args, wrapper, run)
        return steps.planned[call_sinks]

    # -- per layer ---------------------------------------------------------------------
    def write(self, plan, cache, key, value, layer):
        steps = plan.prepared
        a = plan.meta.num_actual_tokens
        if a == 0:
            return cache
        # append_paged_kv_cache takes exactly the real tokens, in the cache dtype.
        key, value = key[:a].to(steps.torch_dtype), value[:a].to(steps.torch_dtype)
        k_view, v_view = cache.kv_view(layer, 0), cache.kv_view(layer, 1)
        pair = paged_kv_tensors(k_view, v_view, steps.kv_layout)
        t = steps.append
        self.lib().append_paged_kv_cache(key, value, t["batch_indices"], t["positions"], pair,
                                         t["kv_indices"], t["kv_indptr"],
                                         t["kv_last_page_len"], kv_layout=t["kv_layout"])
        return cache

    def attend(self, plan, cache, query, layer, sinks, out, return_lse):
        steps = plan.prepared
        if sinks is None or sinks is plan.sinks:
            args, wrapper, run = self._planned(plan, steps, False)
        else:  # sinks are claimed only where run() takes them (capabilities)
            args, wrapper, run = self._planned(plan, steps, True)
            run = dict(run, sinks=self.device_sinks(sinks))
        q, k_view, v_view, o, lse = self.step_tensors(plan, query, cache, layer, out,
                                                      return_lse)
        a = args["num_actual_tokens"]
        if a:
            res, l2 = wrapper.run(q[:a], paged_kv_tensors(k_view, v_view, steps.kv_layout),
                                  **run)
            o[:a] = res
            if lse is not None:
                lse[:a] = l2.float() * args["lse_scale"]
        return o, lse


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
