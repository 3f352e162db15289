"""The ``cuda.flash_attn`` backend: an adapter onto flash-attn 2's varlen paged interface.

Attention goes through ``flash_attn_varlen_func`` with a ``block_table``; flash-attn has no
cache-write op of its own, so writes are torch index_put through kvabi's strided views.
flash-attn 2 requires a paged block size that is a multiple of 256.  All argument
translation lives in the pure :func:`kvabi_cuda.flash_attn_args.flash_attn_args`.
"""
from __future__ import annotations

import attrs
import numpy as np

from . import tensors
from .flash_attn_args import flash_attn_args
from .library_backend import LibraryBackend
from kvabi import AttentionOptions, check_kv, check_query, check_step
from .torch_write import write_kv_torch


@attrs.define(eq=False)
class FlashAttnPlan:
    meta: object
    spec: object
    layout: object
    opts: AttentionOptions
    args: dict  # the translated arguments, numpy
    tensors: dict  # the same, as device tensors
    slots: object  # [T] int64 device tensor


class FlashAttnBackend(LibraryBackend):
    """flash-attn 2's paged varlen attention behind kvabi's ABI."""

    name = "cuda.flash_attn"
    module = "flash_attn"
    extra = "flash-attn"
    first_layouts = ("flash_attn",)

    def base_capabilities(self) -> dict:
        return dict(kinds=("full", "sliding_window", "chunked_local"),
                    dtypes=("float16", "bfloat16"), head_dims=tuple(range(8, 257, 8)),
                    block_sizes=None, block_size_multiple=256, softcap=True, sinks=False,
                    notes="flash-attn 2 varlen with block_table: paged block size a "
                          "multiple of 256, head dim a multiple of 8 up to 256, D "
                          "contiguous; chunked local via kvabi's virtual batches; no sinks")

    def plan(self, meta, spec, layout, *, scale=None, softcap=None, sinks=None):
        self._require_available()
        check_step(meta, spec, layout)
        self.check_supported(spec, softcap=softcap, sinks=sinks)
        opts = AttentionOptions.resolve(spec, scale, softcap, sinks)
        args = flash_attn_args(meta, spec, scale=opts.scale, softcap=opts.softcap)
        dev = self.device()
        t = {k: tensors.to_torch(v, dev) for k, v in args.items() if isinstance(v, np.ndarray)}
        slots = tensors.to_torch(meta.slot_mapping.astype(np.int64), dev)
        return FlashAttnPlan(meta, spec, layout, opts, args, t, slots)

    def write_kv(self, cache, layout, key, value, plan, *, layer: int = 0):
        self.check_plan(plan, layout, FlashAttnPlan)
        spec = plan.spec
        check_kv(key, value, plan.meta, spec)
        dev = self.device()
        k_view, v_view = self.views(layout, cache, layer, spec)
        write_kv_torch(tensors.to_torch(key, dev), tensors.to_torch(value, dev), k_view,
                       v_view, plan.slots, spec.block_size)
        return cache

    def attention(self, query, cache, layout, plan, *, layer: int = 0, return_lse=False):
        self.check_plan(plan, layout, FlashAttnPlan)
        spec, meta, args, t = plan.spec, plan.meta, plan.args, plan.tensors
        hq = check_query(query, meta, spec)
        q, k_view, v_view, out, lse = self.step_tensors(query, cache, layout, plan, layer, hq)
        a = args["num_actual_tokens"]
        if a:
            o, l, _ = self.lib().flash_attn_varlen_func(
                q[:a], k_view, v_view, cu_seqlens_q=t["cu_seqlens_q"],
                cu_seqlens_k=t["cu_seqlens_k"], max_seqlen_q=args["max_seqlen_q"],
                max_seqlen_k=args["max_seqlen_k"], softmax_scale=args["softmax_scale"],
                causal=args["causal"], window_size=args["window_size"],
                softcap=args["softcap"], return_attn_probs=True,
                block_table=t["block_table"])
            out[:a] = o.to(out.dtype)
            lse[:a] = l.float().transpose(0, 1)  # flash-attn's lse is [Hq, total_q]
        return (out, lse) if return_lse else out
