"""The ``cuda.flash_attn`` backend: an adapter onto flash-attn 2's varlen paged interface.

Attention goes through ``flash_attn_varlen_func`` with a ``block_table``; flash-attn has no
cache-write op of its own, so writes are torch index_put through kvabi's strided views, at
block/row indices computed once per step.  flash-attn 2 requires a paged block size that is
a multiple of 256, and has no attention sinks.  All argument translation lives in the pure
:func:`kvabi_cuda.flash_attn_args.flash_attn_args`.
"""
from __future__ import annotations

import attrs
import numpy as np

from kvabi import UnsupportedError, check_kv, check_step
from kvabi.tensors import to_torch, torch_dtype

from . import boundary
from .flash_attn_args import flash_attn_args
from .library_backend import LibraryBackend
from .torch_write import write_kv_torch, write_rows


@attrs.define(eq=False)
class FlashAttnPlan:
    meta: object
    spec: object
    layout: object
    opts: object  # AttentionOptions
    num_q_heads: int | None
    torch_dtype: object
    args: dict  # the translated arguments, numpy
    tensors: dict  # the same, as device tensors
    rows: tuple  # (real tokens, their blocks, their rows) as device tensors


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

    def plan(self, meta, spec, layout, *, num_q_heads=None, scale=None, softcap=None,
             sinks=None):
        self._require_available()
        check_step(meta, spec, layout)
        self.check_supported(spec, softcap=softcap, sinks=sinks)
        self.check_layout(layout, spec)
        opts, hq = boundary.plan_options(spec, num_q_heads, scale, softcap, sinks)
        args = flash_attn_args(meta, spec, scale=opts.scale, softcap=opts.softcap)
        dev = self.device()
        t = {k: to_torch(v, dev) for k, v in args.items() if isinstance(v, np.ndarray)}
        rows = tuple(to_torch(a, dev) for a in write_rows(meta.slot_mapping, spec.block_size))
        return FlashAttnPlan(meta, spec, layout, opts, hq, torch_dtype(spec.dtype), args, t,
                             rows)

    def write_kv(self, cache, layout, key, value, plan, *, layer: int = 0):
        c = self.cache(cache, layout, plan, FlashAttnPlan)
        spec = plan.spec
        check_kv(key, value, plan.meta, spec)
        dev = self.device()
        write_kv_torch(to_torch(key, dev), to_torch(value, dev), c.kv_view(layer, 0),
                       c.kv_view(layer, 1), plan.rows)
        return cache

    def attention(self, query, cache, layout, plan, *, layer: int = 0, sinks=None, out=None,
                  return_lse=False):
        c = self.cache(cache, layout, plan, FlashAttnPlan)
        if sinks is not None:
            raise UnsupportedError(f"{self.name}: unsupported: attention sinks not supported")
        args, t = plan.args, plan.tensors
        hq = boundary.query_heads(query, plan)
        q, k_view, v_view, o, lse = self.step_tensors(query, c, plan, layer, hq, out,
                                                      return_lse)
        a = args["num_actual_tokens"]
        if a:
            res, l, _ = self.lib().flash_attn_varlen_func(
                q[:a], k_view, v_view, cu_seqlens_q=t["cu_seqlens_q"],
                cu_seqlens_k=t["cu_seqlens_k"], max_seqlen_q=args["max_seqlen_q"],
                max_seqlen_k=args["max_seqlen_k"], softmax_scale=args["softmax_scale"],
                causal=args["causal"], window_size=args["window_size"],
                softcap=args["softcap"], return_attn_probs=True,
                block_table=t["block_table"])
            o[:a] = res
            if lse is not None:
                lse[:a] = l.float().transpose(0, 1)  # flash-attn's lse is [Hq, total_q]
        return (o, lse) if return_lse else o
