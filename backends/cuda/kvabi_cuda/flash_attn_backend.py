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

from kvabi.util.tensors import to_torch, torch_dtype

from .flash_attn_args import flash_attn_args
from .library_backend import LibraryBackend
from .torch_write import write_kv_torch, write_rows


@attrs.frozen(eq=False)
class FlashAttnSteps:
    """What the flash-attn adapter prepares for a step."""

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

    def prepare(self, plan) -> FlashAttnSteps:
        meta, spec, dev = plan.meta, plan.spec, self.device()
        args = flash_attn_args(meta, spec, scale=plan.scale, softcap=plan.softcap)
        t = {k: to_torch(v, dev) for k, v in args.items() if isinstance(v, np.ndarray)}
        rows = tuple(to_torch(a, dev) for a in write_rows(meta.slot_mapping, spec.block_size))
        return FlashAttnSteps(torch_dtype(spec.dtype), args, t, rows)

    def write(self, plan, cache, key, value, layer):
        write_kv_torch(key, value, cache.kv_view(layer, 0), cache.kv_view(layer, 1),
                       plan.prepared.rows)
        return cache

    def attend(self, plan, cache, query, layer, sinks, out, return_lse):
        # no sinks are claimed (capabilities): a plan has none, and per-call ones are refused
        args, t = plan.prepared.args, plan.prepared.tensors
        q, k_view, v_view, o, lse = self.step_tensors(plan, query, cache, layer, out,
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
        return o, lse
